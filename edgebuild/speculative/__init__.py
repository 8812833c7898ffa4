"""Speculative decoding, the parts every layer may read: the config and the method registry.

Neutral ground between the build (recipes, bundles) and the runtime: it imports neither.
"""

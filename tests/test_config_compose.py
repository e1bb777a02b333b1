"""Every group choice composes; every YAML line is commented; every object builds; bad choices fail clearly."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from fgcli_helpers import CONF, compose_cfg

GROUPS = ("model", "weights", "window", "ple", "fuse", "quant", "lm_head", "spec", "graphs", "attention", "sampler",
          "workload", "eval", "logger", "task", "experiment")
CHOICES = [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]


def test_every_design_group_has_a_folder_and_its_baseline():
    baseline = {"model": "gemma4_e4b", "weights": "synthetic", "window": "native", "ple": "project", "quant": "bf16",
                "lm_head": "full", "spec": "none", "graphs": "eager", "attention": "torch", "sampler": "argmax",
                "workload": "challenge", "eval": "none", "logger": "wandb"}
    cfg = compose_cfg([])
    assert {g: cfg.hydra.runtime.choices[g] for g in baseline} == baseline
    for g in GROUPS:
        assert (CONF / g).is_dir(), g
    assert {p.stem for p in (CONF / "experiment").glob("*.yaml")} >= {"baseline_bf16", "quality_safe", "frontier"}


@pytest.mark.parametrize("group,choice", CHOICES, ids=[f"{g}={c}" for g, c in CHOICES])
def test_choice_composes(group, choice):
    cfg = compose_cfg([f"{group}={choice}"])
    assert cfg.hydra.runtime.choices[group] == choice


def _yaml_files():
    return sorted(CONF.rglob("*.yaml"))


def test_every_yaml_line_is_commented():
    bad = []
    for f in _yaml_files():
        lines = f.read_text().splitlines()
        assert lines and lines[0].startswith("#"), f"{f} does not open with a comment"
        for n, line in enumerate(lines, 1):
            if line.strip() and "#" not in line:
                bad.append(f"{f.relative_to(CONF)}:{n}: {line}")
    assert not bad, "uncommented YAML lines:\n" + "\n".join(bad)


def test_experiments_are_global_recipes():
    for f in (CONF / "experiment").glob("*.yaml"):
        assert f.read_text().startswith("# @package _global_\n"), f


def _target_exists(target: str) -> bool:
    mod, _, name = target.rpartition(".")
    try:
        return hasattr(importlib.import_module(mod), name)
    except ImportError:
        return False


@pytest.mark.parametrize("group", ["window", "ple", "fuse", "quant", "lm_head", "spec", "graphs", "attention", "sampler",
                                   "workload", "eval", "logger", "model"])
def test_each_choice_builds_a_plain_object(group, tmp_path):
    """The builder instantiates every choice whose class is installed; none of them is a DictConfig."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig, open_dict

    from fastgemma import build

    for f in sorted((CONF / group).glob("*.yaml")):
        cfg = compose_cfg([f"{group}={f.stem}"])
        with open_dict(cfg):
            cfg.hydra.runtime.cwd = str(tmp_path)
        HydraConfig.instance().set_config(cfg)
        target = cfg[group].get("_target_")
        if target is None:
            assert build.instantiate_group(cfg, group) is None
            continue
        assert _target_exists(target), f"{group}={f.stem}: {target} missing"
        if f.stem == "nf4" and importlib.util.find_spec("bitsandbytes") is None:
            with pytest.raises(build.BuildError, match="bitsandbytes"):
                build.instantiate_group(cfg, group, {group: f.stem})
            continue
        obj = build.instantiate_group(cfg, group, {group: f.stem})
        assert obj is not None and not isinstance(obj, DictConfig), f"{group}={f.stem}"


def test_task_ppl_brings_eval_ppl_and_hf_brings_checkpoint_model():
    cfg = compose_cfg(["task=ppl"])
    assert cfg.hydra.runtime.choices.eval == "ppl" and cfg.eval.chunk > 0
    cfg = compose_cfg(["weights=hf"])
    assert cfg.hydra.runtime.choices.model == "checkpoint"
    cfg = compose_cfg(["weights=hf", "model=gemma4_tiny"])  # the command line wins
    assert cfg.model.name == "gemma4_tiny"


def test_experiment_overrides_and_command_line_wins():
    cfg = compose_cfg(["experiment=frontier"])
    ch = cfg.hydra.runtime.choices
    assert cfg.window.size == 188 and ch.quant == "int4" and ch.fuse == "layers" and cfg.fuse.pdl
    assert ch.lm_head == "pruned" and cfg.lm_head.rows == 12288 and ch.sampler == "fused_argmax"
    assert cfg.lm_head.dtype == "int8"  # the kept rows in int8 (run KE)
    cfg = compose_cfg(["experiment=frontier", "window=native"])
    assert cfg.window.size is None


def test_unknown_choice_names_the_options():
    with pytest.raises(ConfigCompositionException, match=r"(?s)Could not find 'quant/int3'.*Available options"):
        compose_cfg(["quant=int3"])


@pytest.mark.parametrize("override", ["foo=1", "quant.group_size=32", "window.width=3"])
def test_unknown_key_is_refused(override):
    with pytest.raises((ConfigCompositionException, ConfigKeyError, ConfigAttributeError), match="Could not override"):
        compose_cfg([override])


def test_launchers_compose():
    for name in ("gpus", "slurm"):
        cfg = compose_cfg([f"hydra/launcher={name}"])
        assert "submitit" in cfg.hydra.launcher._target_
    assert (Path(CONF).parent / "launchers").is_dir()


def test_spec_depth_sweeps_across_every_spec_choice():
    """`-m spec=none,mtp,replay spec.depth=k`: each job composes and builds; spec=none stays plain AR."""
    from hydra.utils import instantiate

    for choice in ("none", "mtp", "replay"):
        d = instantiate(compose_cfg([f"spec={choice}", "spec.depth=3"]).spec).describe()
        assert d == {"spec": "none"} if choice == "none" else (d["spec"], d["depth"]) == (choice, 3)


def test_a_key_some_swept_choice_lacks_is_named_before_any_job():
    from fastgemma.sweep_check import key_mismatches

    bad = key_mismatches(["-m", "quant=int4,int8", "quant.group_size=64", "window=w188"], CONF)
    assert bad == ["quant.group_size: quant=int8 has no key 'group_size' (its keys: skip, backend); the quant "
                   "choices with it: int4; run quant=int8 in a command of its own"]
    assert "the lm_head choices with it: pruned" in key_mismatches(["lm_head=full", "lm_head.rows=64"], CONF)[0]
    # keys every listed choice has, added keys, groups left to their default, flags: nothing to say
    for ok in (["-m", "spec=none,mtp,replay", "spec.depth=3"], ["quant=int4", "quant.group_size=64"],
               ["lm_head=full", "++lm_head.rows=64"], ["quant.group_size=64"], ["--cfg", "job", "quant=int4"],
               ["fuse=layers", "fuse.attn_tiles=[full_store:32x4s2]"], ["quant=int4,", "quant.x=("],
               ["weights=hf", "weights.path=/x"], ["weights=gguf", "weights.spec=x"],  # @package _global_ choices
               ["hydra/launcher=gpus", "hydra.launcher.timeout_min=5"], ["experiment=frontier", "quant.group_size=64"]):
        assert key_mismatches(ok, CONF) == [], ok
    assert "weights=synthetic has no key 'path' (its keys: seed); the weights choices with it: hf" in \
        key_mismatches(["weights=synthetic,hf", "weights.path=/x"], CONF)[0]


def test_no_documented_command_is_refused_by_the_key_check():
    """Every `fastgemma ...` line of the README and docs passes the up-front key check, but the one that shows it."""
    import re
    import shlex

    from fastgemma.sweep_check import key_mismatches

    refused = []
    for doc in ("README.md", "docs/commands.md", "docs/results.md", "docs/quality.md", "docs/h100.md"):
        for line in (Path(CONF).parent / doc).read_text().splitlines():
            m = re.search(r"fastgemma (.*)", line)
            if m:
                cmd = m.group(1).split("#")[0].strip().strip("`")
                if key_mismatches(shlex.split(cmd, posix=True) if cmd.count("'") % 2 == 0 else cmd.split(), CONF):
                    refused.append(cmd)
    assert refused == ["-m model=gemma4_tiny quant=int4,int8 quant.group_size=32"]

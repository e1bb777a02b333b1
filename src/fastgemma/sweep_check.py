"""A group's keys on the command line checked against the choices they would apply to, before any job runs.

`fastgemma -m quant=int4,int8 quant.group_size=64`: int8 has no group_size, and Hydra composes each job's
config only when it launches that job, so the int4 jobs would run and the sweep then stop at the first int8
job with "Key 'group_size' is not in struct" and the advice to append the key (`+quant.group_size`), which
int8's quantizer would refuse. `key_mismatches` finds such keys up front from the command line alone: a
`group.key=...` override (not `+` / `++`) where `group=...` lists a choice whose YAML lacks `key`. A group
left to its default or an experiment is not checked (Hydra's own message names that case).
"""
from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf


def _parse(args: list[str]):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    # flags (-m, --cfg job, ...) and their values are Hydra's; overrides are the arguments with a '='
    return OverridesParser.create().parse_overrides([a for a in args if "=" in a and not a.startswith("-")])


def _keys(path: Path, group: str) -> list[str] | None:
    """The keys choice `path` gives its group's node, or None where the YAML alone cannot tell (a package other
    than the group's or _global_, a defaults list that brings in other configs)."""
    text = path.read_text()
    head = next((ln for ln in text.splitlines() if ln.startswith("# @package")), "")
    package = head.split()[2] if len(head.split()) > 2 else "_group_"
    node = OmegaConf.create(text)
    if package == "_global_":
        node = node.get(group)
    elif package != "_group_":
        return None
    if node is None or any(not (isinstance(d, dict) and all(str(k).startswith("override ") for k in d))
                           for d in (node.get("defaults") or [])):
        return None
    return [str(k) for k in node if not str(k).startswith("_") and k != "defaults"]


def _choices(o) -> list[str]:
    if o.is_sweep_override():
        return [str(v) for v in o.sweep_string_iterator()]
    return [str(o.value())]


def key_mismatches(args: list[str], conf_dir: Path) -> list[str]:
    """-> one message per `group.key` override that some listed choice of `group` has no `key` for."""
    try:
        overrides = _parse(args)
    except Exception:  # noqa: BLE001 -- what Hydra cannot parse, Hydra reports itself
        return []
    choices = {o.key_or_group: _choices(o) for o in overrides
               if "." not in o.key_or_group and (conf_dir / o.key_or_group).is_dir() and not o.is_delete()}
    out, read = [], {}  # read: each group's choices' keys, its YAMLs read once
    for o in overrides:
        group, _, key = o.key_or_group.partition(".")
        if not key or group not in choices or o.is_add() or o.is_force_add() or o.is_delete():
            continue
        top = key.partition(".")[0]
        if group not in read:
            read[group] = {p.stem: _keys(p, group) for p in sorted((conf_dir / group).glob("*.yaml"))}
        keys = read[group]
        with_key = [c for c, ks in keys.items() if ks is not None and top in ks]
        for c in choices[group]:
            if keys.get(c) is None or top in keys[c]:
                continue  # an unknown choice (Hydra names the options) or one the YAML alone does not settle
            alone = f"; run {group}={c} in a command of its own" if len(choices[group]) > 1 else ""
            out.append(f"{o.key_or_group}: {group}={c} has no key {top!r} (its keys: {', '.join(keys[c]) or 'none'}); "
                       f"the {group} choices with it: {', '.join(with_key) or 'none'}{alone}")
    return out

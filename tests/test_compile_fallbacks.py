"""engine/compile.py: every fastgemma custom op gets its inductor fallback before a step is compiled,
so inductor never takes its implicit-fallback path (torch 2.11 formats the op's arguments' IR
there, recursively: the one-row step with the q/k/v kernel never finished compiling on the H200)."""
import re
from pathlib import Path

import torch

from fastgemma.engine.compile import OP_MODULES, compile_step, fastgemma_ops, register_fallbacks

KERNELS = Path(__file__).resolve().parents[1] / "src" / "fastgemma" / "kernels"


def test_every_custom_op_is_found():
    """OP_MODULES names every kernels module that defines an op, and fastgemma_ops finds them all."""
    defined = {}
    for f in KERNELS.glob("*.py"):
        for name in re.findall(r'custom_op\("fastgemma::(\w+)"', f.read_text()):
            defined[name] = f.stem
    assert defined and set(defined.values()) == set(OP_MODULES)
    found = {op.name().split("::")[1].split(".")[0] for op in fastgemma_ops()}
    assert found == set(defined)


def test_compiled_ops_take_the_registered_fallback(monkeypatch):
    """A compiled function with a fastgemma op lowers it without the implicit path (inductor's FX
    graph cache off, so the graph is lowered here; without register_fallbacks it takes that path)."""
    import torch._inductor.config as inductor_config
    from torch._inductor import graph, lowering

    register_fallbacks()
    assert all(op in lowering.lowerings for op in fastgemma_ops())
    assert register_fallbacks() == 0  # idempotent
    implicit = []
    real_info = graph.log.info

    def info(msg, *args, **kw):
        if "implicit fallback" in str(msg):
            implicit.append(str(args[0]) if args else msg)
        return real_info(msg, *args, **kw)

    monkeypatch.setattr(graph.log, "info", info)
    torch._dynamo.reset()
    fn = compile_step(lambda x: torch.ops.fastgemma.argmax_last(torch.tanh(x) * 2.0) + 1)
    x = torch.randn(3, 50)
    with inductor_config.patch(fx_graph_cache=False):  # lowered here, not read from the cache
        assert torch.equal(fn(x), torch.argmax(torch.tanh(x) * 2.0, -1, keepdim=True) + 1)
    assert not [m for m in implicit if "fastgemma" in m], implicit
    torch._dynamo.reset()

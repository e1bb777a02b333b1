"""The prompt's fast paths on the tiny model (fp32, CPU): padding in front to a bucket (what the
prompt graphs replay) leaves the last hidden state and every later token as the unpadded prefill
does, for prompts shorter and longer than the window's ring buffer, with pads wider than the
ring's slack, for speculative decoding and for a batch; the compiled (dynamic) forward equals eager.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from conftest import TINY
from fastgemma.engine.cache import KVCache
from fastgemma.engine.generator import Generator, GenerationError
from fastgemma.engine.speculative import SpecGenerator
from fastgemma.engine.steps import EagerStep, StaticStep
from fastgemma.kernels.decode_attention import decode_attention_ref
from fastgemma.model.config import FULL, SLIDING
from fastgemma.model.drafter import synthetic_drafter
from fastgemma.transforms.graphs import CudaGraph
from fastgemma.weights.synthetic import synthetic_model

WINDOW = 12  # ring = 12 + 16 slots = 28
NEW = 12


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    m = synthetic_model(TINY, dtype=torch.float32, seed=5)
    m.step_attention = decode_attention_ref
    return m


def _prompt(T, seed=0):
    g = torch.Generator().manual_seed(seed + T)
    return torch.randint(1, TINY.vocab_size, (T,), generator=g).tolist()


def _gen(model, bucket, step_cls=EagerStep, max_ctx=96, chunk=2048, batch=1):
    cache = KVCache(TINY, batch, max_ctx, window=WINDOW, dtype=torch.float32)
    return Generator(model, cache, step_cls(model, cache), prefill_chunk=chunk, prefill_bucket=bucket)


def test_padded_length_rules(model):
    g = _gen(model, 16, max_ctx=40, chunk=32)
    assert [g.padded_length(t) for t in (1, 16, 17, 32)] == [16, 16, 32, 32]
    assert g.padded_length(33) is None  # longer than a chunk: chunked, unpadded
    g = _gen(model, 16, max_ctx=40)
    assert g.padded_length(33) == 40 and g.padded_length(39) == 40  # capped by the cache
    assert g.padded_length(40) is None  # no slot left for the pads' position
    assert _gen(model, 0).padded_length(5) is None
    assert not g.capture_prefill  # graphs on CUDA only; the CPU pads without them
    # switching the path drops the captured graphs and their pool's handle: torch releases a private
    # pool with its last graph, so the next captures need a new one (on the H200, capturing into the
    # old handle failed an allocator assert)
    g._prefill_graphs[16], g._graph_pool = ("graph",), ("pool",)
    g.set_prefill(False, 32)
    assert g._prefill_graphs == {} and g._graph_pool is None and g.padded_length(17) == 32


@pytest.mark.parametrize("T", [1, 5, 15, 16, 17, 27, 28, 29, 40])
@pytest.mark.parametrize("bucket", [16, 64])
def test_padded_prefill_equals_unpadded(model, T, bucket):
    """bucket 64 puts up to 63 pads in front: more than the ring's 16 slots of slack."""
    ids = torch.tensor([_prompt(T)])
    ref_gen, pad_gen = _gen(model, 0), _gen(model, bucket)
    ref = ref_gen.prefill(ids)
    got = pad_gen.prefill(ids)
    assert pad_gen.padded_length(T) == -(-T // bucket) * bucket
    assert (got - ref).abs().max().item() < 1e-5
    # the caches then decode alike: the pads' writes are invisible or overwritten
    for cls in (EagerStep, StaticStep):
        a = _gen(model, 0, cls).generate(_prompt(T), NEW).tokens
        b = _gen(model, bucket, cls).generate(_prompt(T), NEW).tokens
        assert a == b, (cls.__name__, T)


def test_padded_prefill_batch(model):
    ids = torch.tensor([_prompt(21), _prompt(21, seed=9)])
    ref = _gen(model, 0, batch=2).prefill(ids)
    got = _gen(model, 16, batch=2).prefill(ids)
    assert (got - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("k", [1, 4, 7])
def test_spec_with_padded_prefill_equals_ar(model, k):
    """The drafter's first step reads the target's cache right after the prefill: keys at the pads'
    position are masked for it (it attends strictly before the next position)."""
    drafter = synthetic_drafter(TINY, dtype=torch.float32, seed=0)
    for T in (5, 23):
        ar = _gen(model, 0).generate(_prompt(T), NEW).tokens
        cache = KVCache(TINY, 1, T + NEW, window=WINDOW, dtype=torch.float32)
        gen = SpecGenerator(model, cache, drafter, k, prefill_bucket=64)
        assert gen.prefill_bucket == 64
        assert gen.generate(_prompt(T), NEW).tokens == ar


def test_spec_with_the_prompt_by_layer_regions_equals_ar(model):
    """graphs=compiled's prompt path under speculative decoding: the layer regions compiled, the phases eager."""
    drafter = synthetic_drafter(TINY, dtype=torch.float32, seed=0)
    ar = _gen(model, 0).generate(_prompt(23), NEW).tokens
    gen = SpecGenerator(model, KVCache(TINY, 1, 23 + NEW, window=WINDOW, dtype=torch.float32), drafter, 4,
                        compile_prefill="layers", prefill_bucket=0)
    assert gen.compile_prefill == "layers"
    assert gen.generate(_prompt(23), NEW).tokens == ar


def test_bad_buckets_are_refused(model):
    with pytest.raises(GenerationError, match="prefill_bucket"):
        _gen(model, -1)
    with pytest.raises(ValueError, match="prefill_bucket"):
        CudaGraph(prefill_bucket=-2)
    with pytest.raises(GenerationError, match="prefill_chunk"):
        _gen(model, 0, chunk=0)
    assert CudaGraph().describe()["prefill_bucket"] == 64


def test_compiled_prefill_matches_eager():
    """torch.compile(dynamic=True) of the prompt's forward (graphs=compiled) equals eager; one
    compilation serves prompts shorter and longer than the ring (28 slots here), padded or not; a
    prompt of two chunks (the second starts at 32) adds one, for the chunk before the last."""
    from torch._dynamo.utils import counters

    cfg = dataclasses.replace(TINY, num_layers=4, num_kv_shared_layers=2, layer_types=(SLIDING, FULL) * 2)
    m = synthetic_model(cfg, dtype=torch.float32, seed=1)
    torch._dynamo.reset()
    mk = lambda c: Generator(m, KVCache(cfg, 1, 96, window=WINDOW, dtype=torch.float32),  # noqa: E731
                             prefill_chunk=32, compile_prefill=c)
    eager, compiled = mk(False), mk(True)
    assert compiled.compile_prefill and not eager.compile_prefill

    def check(T):
        ids = torch.tensor([_prompt(T)])
        err = (compiled.prefill(ids) - eager.prefill(ids)).abs().max().item()
        print(f"compiled prefill T={T} bucket {compiled.prefill_bucket}: max abs diff {err:.2e}")
        assert err < 1e-4

    graphs = counters["stats"]["unique_graphs"]
    for T in (7, 30):
        check(T)
    compiled.set_prefill(True, 16)  # the padded path (no capture on a CPU): pads in front
    for T in (5, 20):
        check(T)
    assert counters["stats"]["unique_graphs"] - graphs == 1
    compiled.set_prefill(True, 0)
    check(45)
    assert counters["stats"]["unique_graphs"] - graphs == 2  # + the chunk before the last (need="none")


@pytest.mark.parametrize("pairs, stack", [(2, "plain"), (4, "plain"), (2, "int4"), (4, "int4")])
def test_prefill_compiled_by_layer_regions_matches_eager(pairs, stack):
    """compile_prefill="layers": each decoder layer's pieces (PromptRegions: q / k / v, the cache writes, the attention,
    the rest) compiled with dynamic=True equal eager for prompts shorter and longer than the ring, padded or not,
    in one chunk or two; and the compilations do not grow with the layers: twice the layers of the same kinds,
    the same count (a piece a kind: sliding / full, storing K/V / KV-shared, and the shared layers' one last
    row). The same with bench's int4 stack (merged q|k|v and gate|up, int4 body on the torch twin, fused step),
    whose layers carry their own bound methods and quantized modules."""
    from torch._dynamo.utils import counters

    from fastgemma.bench.spec import build_stack

    cfg = dataclasses.replace(TINY, num_layers=2 * pairs, num_kv_shared_layers=2, layer_types=(SLIDING, FULL) * pairs)
    m = (synthetic_model(cfg, dtype=torch.float32, seed=1) if stack == "plain"
         else build_stack(cfg, "cpu", "full", torch.float32, fuse=True)[0])
    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    mk = lambda c: Generator(m, KVCache(cfg, 1, 96, window=WINDOW, dtype=torch.float32),  # noqa: E731
                             prefill_chunk=32, compile_prefill=c)
    eager, regional = mk(False), mk("layers")
    assert regional.compile_prefill == "layers"
    for T, bucket in ((7, 0), (30, 0), (5, 16), (20, 16), (45, 0)):
        regional.set_prefill("layers", bucket)
        ids = torch.tensor([_prompt(T)])
        err = (regional.prefill(ids) - eager.prefill(ids)).abs().max().item()
        assert err < 1e-4, (T, bucket, err)
    assert counters["stats"]["unique_graphs"] - graphs == 15


def test_layer_regions_compile_once_when_the_first_prompt_has_a_weight_size():
    """A first prompt as long as a head_dim (32 and 64 here; 256 and 512 on E4B, both padded lengths) compiles
    the regions for every length: without duck sizing its length does not take the weight's static size."""
    from torch._dynamo.utils import counters

    cfg = dataclasses.replace(TINY, num_layers=4, num_kv_shared_layers=2, layer_types=(SLIDING, FULL) * 2)
    m = synthetic_model(cfg, dtype=torch.float32, seed=1)
    eager = Generator(m, KVCache(cfg, 1, 96, window=WINDOW, dtype=torch.float32), prefill_chunk=64)
    for first in (cfg.head_dim, cfg.global_head_dim):
        torch._dynamo.reset()
        regional = Generator(m, KVCache(cfg, 1, 96, window=WINDOW, dtype=torch.float32), prefill_chunk=64,
                             compile_prefill="layers")
        graphs = []
        for T in (first, 20, 45, 7):
            ids = torch.tensor([_prompt(T)])
            assert (regional.prefill(ids) - eager.prefill(ids)).abs().max().item() < 1e-4
            graphs.append(counters["stats"]["unique_graphs"])
        assert graphs == graphs[:1] * 4, (first, graphs)


def test_chunk_starts_keep_the_last_chunk_long():
    from fastgemma.engine.generator import MIN_LAST_CHUNK, chunk_starts

    assert chunk_starts(40, 16) == [0, 16, 32]  # a last chunk of 8 as it is
    assert chunk_starts(33, 16) == [0, 16, 25]  # 1 token left: the last chunk takes 8
    assert chunk_starts(5, 16) == [0] and chunk_starts(16, 16) == [0] and chunk_starts(17, 4) == [0, 4, 8, 12, 13]
    assert MIN_LAST_CHUNK == 8
    for T in range(1, 70):
        for c in (1, 3, 8, 16, 32):
            s = chunk_starts(T, c)
            ends = s[1:] + [T]
            assert s[0] == 0 and all(0 < e - b <= c for b, e in zip(s, ends))
            assert T - s[-1] >= min(T, c, MIN_LAST_CHUNK)


def test_a_prompt_one_token_past_a_chunk_compiles_nothing_new_and_equals_one_chunk():
    """Chunks of 32: a 33-token prompt runs as 32 - 7 = 25 + 8 tokens (no 1-token chunk, so no compile of its
    own after a 40-token prompt), and its last hidden state is the one-chunk prefill's."""
    from torch._dynamo.utils import counters

    cfg = dataclasses.replace(TINY, num_layers=4, num_kv_shared_layers=2, layer_types=(SLIDING, FULL) * 2)
    m = synthetic_model(cfg, dtype=torch.float32, seed=1)
    whole = Generator(m, KVCache(cfg, 1, 96, window=WINDOW, dtype=torch.float32), prefill_chunk=64)
    torch._dynamo.reset()
    regional = Generator(m, KVCache(cfg, 1, 96, window=WINDOW, dtype=torch.float32), prefill_chunk=32,
                         compile_prefill="layers")
    regional.prefill(torch.tensor([_prompt(40)]))
    graphs = counters["stats"]["unique_graphs"]
    ids = torch.tensor([_prompt(33)])
    assert (regional.prefill(ids) - whole.prefill(ids)).abs().max().item() < 1e-4
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("bad", ["layer", "true", 1, 0.0, None, [True]])
def test_compile_prefill_values_are_checked(model, bad):
    with pytest.raises(GenerationError, match="compile_prefill must be"):
        Generator(model, KVCache(TINY, 1, 64, window=WINDOW, dtype=torch.float32)).set_prefill(bad, 0)
    if bad is not None:  # None: the config's "as compile"
        with pytest.raises(ValueError, match="compile_prefill must be"):
            CudaGraph(compile_prefill=bad)
    assert CudaGraph(compile=True, compile_prefill=True).describe()["compile_prefill"] is True
    # unsaid: the layer regions with a compiled step (graphs=compiled's default), eager without
    assert CudaGraph(compile=True).describe()["compile_prefill"] == "layers"
    assert CudaGraph().describe()["compile_prefill"] is False


def test_graphs_compiled_config_compiles_the_prompt_by_layer_regions():
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(Path(__file__).parents[1] / "conf" / "graphs" / "compiled.yaml")
    assert instantiate(cfg).describe()["compile_prefill"] == "layers"


def test_warm_on_side_stream_runs_on_a_side_stream(monkeypatch):
    """The warm-up before every capture (decode step, speculative phases, prompt graphs): fn runs
    `iters` times inside the side stream's context, which first waits for the current stream, and
    the current stream then waits for it (stream calls recorded with stand-ins: no GPU here)."""
    import contextlib

    from fastgemma.engine import steps

    log = []

    class Stream:
        def __init__(self, name="side"):
            self.name = name

        def wait_stream(self, other):
            log.append(f"{self.name} waits {other.name}")

    current = Stream("current")
    inside = []

    @contextlib.contextmanager
    def stream(s):
        inside.append(s.name)
        yield
        inside.pop()

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: current)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    steps.warm_on_side_stream(lambda: log.append(f"fn on {inside[-1]}"), 2)
    assert log == ["side waits current", "fn on side", "fn on side", "current waits side"]


def test_warm_prefill_runs_each_length_once_on_a_path_without_prompt_graphs(model, monkeypatch):
    """Without captured prompt graphs, warm_prefill(max_len, lengths) runs one prefill of each new length (token id
    0, not a prompt's) and forgets it after; no lengths: nothing runs and the cache is untouched; the tokens of a
    request after it are those without it."""
    cache = KVCache(TINY, 1, 64, window=12, dtype=torch.float32)
    gen = Generator(model, cache, EagerStep(model, cache), prefill_chunk=16)
    assert not gen.capture_prefill
    want = Generator(model, cache, EagerStep(model, cache), prefill_chunk=16).generate(_prompt(20), 6).tokens
    seen, prefill = [], gen.prefill

    def record(ids):
        seen.append((tuple(ids.shape), int(ids.abs().sum())))
        return prefill(ids)

    monkeypatch.setattr(gen, "prefill", record)
    gen.generate(_prompt(20), 2)  # a request's state, which a warm-up with no lengths must leave alone
    ring = cache.ring_pos.clone()
    seen.clear()
    assert gen.warm_prefill(40) == 0 and not seen and torch.equal(cache.ring_pos, ring)
    gen.warm_prefill(40, [12, 40, 12])
    assert seen == [((1, 12), 0), ((1, 40), 0)] and (cache.ring_pos == -1).all()
    gen.warm_prefill(40, [30, 40, 12])
    assert seen[2:] == [((1, 30), 0)]  # 12 and 40 already ran on this path
    seen.clear()
    assert gen.generate(_prompt(20), 6).tokens == want

"""generate: decode one prompt (text through the tokenizer, or token ids) and print it."""
from __future__ import annotations

from ..metrics.latency import latency_summary
from ..metrics.timing import phase


def run(ctx):
    f, p = ctx.factory, ctx.params
    setup, compiles = {}, {}  # seconds and torch.compile graphs per setup phase (logged as each starts and ends)
    with phase("model (weights, transforms)", setup, f.device, compiles):
        f.model  # built (and checked) first: a bad stack is reported before a missing prompt
    text, ids = p.get("prompt"), p.get("ids")
    if (text is None) == (ids is None):
        raise ValueError("task=generate needs exactly one of task.prompt=<text> or task.ids=[<int>, ...]")
    tok = f.tokenizer()
    if ids is None:
        if tok is None:
            raise ValueError("task.prompt is text but these weights have no tokenizer: pass task.ids=[...], "
                             "tokenizer=bytes (a byte tokenizer) or tokenizer=<dir>")
        from ..workloads.tokenizer import encode, encode_chat

        ids = encode_chat(tok, text) if p.get("chat", False) else encode(tok, text)
    elif p.get("chat", False):
        raise ValueError("task.chat=true wraps a text prompt (task.prompt) in the chat template; task.ids are "
                         "passed as they are")
    ids = [int(t) for t in ids]
    n = int(p.get("max_new_tokens", 64))
    with phase("engine (cache, step capture / compile)", setup, f.device, compiles):
        engine = f.engine(len(ids) + n)
    # graphs=cuda_graph / compiled: the prompt's padded length captured (and compiled) before the clock
    with phase(f"prompt graphs ({len(ids)} tokens)", setup, f.device, compiles):
        engine.generator.warm_prefill(len(ids))
    g = engine.generator.generate(ids, n, ignore_eos=bool(p.get("ignore_eos", False)))
    metrics, _ = latency_summary([g], g.total_s)
    out = tok.decode(g.tokens, skip_special_tokens=True) if tok is not None else None
    print(f"prompt ({len(ids)} tokens): {text if text is not None else ids}")
    print(f"output ({len(g.tokens)} tokens, {metrics['tps']} tok/s, ttft {metrics['ttft_ms_p50']} ms):")
    print(out if out is not None else g.tokens)
    if out is not None and p.get("show_ids", False):
        print(g.tokens)
    return metrics, {"prompt_ids": ids, "output_ids": g.tokens, "output_text": out, "setup_s": setup,
                     "setup_compiles": compiles}

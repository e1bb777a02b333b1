"""lm_head.source=predicted: a keepset of the ids the model's own full head picks most often over a text."""
import json
from collections import Counter

import pytest
import torch

from fastgemma.metrics.head import prune_miss_rate
from fastgemma.model.config import GEMMA4_TINY
from fastgemma.transforms.gptq import calibration_sequences, prompt_hidden
from fastgemma.transforms.head_predictions import NEAR, predicted_counts
from fastgemma.transforms.lm_head import PrunedHead, keepset_from_counts
from fastgemma.weights.synthetic import synthetic_model

V = GEMMA4_TINY.vocab_size


@pytest.fixture
def model():
    return synthetic_model(GEMMA4_TINY, device="cpu", dtype=torch.float32, seed=0).eval()


def _ids_file(tmp_path, n=3, length=150, seed=3):
    g = torch.Generator().manual_seed(seed)
    p = tmp_path / "calib.jsonl"
    p.write_text("".join(json.dumps({"ids": torch.randint(5, V, (length,), generator=g).tolist()}) + "\n"
                         for _ in range(n)))
    return p


def test_counts_are_the_full_heads_argmax_at_every_position(model, tmp_path):
    """Counted in chunks over a padded batch: the argmax of each sequence's own forward, position by position."""
    seqs = [[2, *range(7, 40)], [2, *range(50, 70)], [2, 9, 9, 9, 11]]
    got, near = predicted_counts(model, seqs, chunk=7, near=3)
    want, want_near = Counter(), Counter()
    for s in seqs:
        h, _ = prompt_hidden(model, [s])
        top = model.compute_logits(h[0]).topk(4, dim=-1).indices
        want.update(top[:, 0].tolist())
        want_near.update(top[:, 1:].flatten().tolist())
    assert got == want and sum(got.values()) == sum(len(s) for s in seqs)
    assert near == want_near and sum(near.values()) == 3 * sum(got.values())
    model.logits_head = torch.nn.Identity()
    with pytest.raises(ValueError, match="needs the model's full head"):
        predicted_counts(model, seqs)


def test_a_predicted_keepset_holds_every_pick_over_its_text(model, tmp_path):
    """With room for every distinct pick, the keepset misses no position of the text it was computed on (its
    miss rate there is 0; a frequency keepset of the same size misses some), the picks come first by count,
    then the runners-up, then the text's own ids, and describe() says so."""
    calib = _ids_file(tmp_path)
    seqs = calibration_sequences([i for line in calib.read_text().splitlines() for i in json.loads(line)["ids"]],
                                 128, 384, GEMMA4_TINY.bos_id)
    h, real = prompt_hidden(model, seqs)
    top = model.compute_logits(h[real]).topk(1 + NEAR, dim=-1).indices
    full = top[:, 0]
    picks, near = Counter(full.tolist()), Counter(top[:, 1:].flatten().tolist())
    rows = len(picks) + 8
    tr = PrunedHead(rows=rows, source="predicted", calib=str(calib), calib_tokens=384, calib_seq_len=128,
                    scatter=False)
    tr.apply(model)
    d = tr.describe()
    assert d["keepset_source"] == "predicted" and d["predicted_positions"] == full.numel()
    assert d["predicted_distinct"] == len(picks) and d["predicted_coverage"] == 1.0 and d["filled"] == 0
    assert d["runners_up_distinct"] == len(set(near) - set(picks))
    assert d["calib"] == [str(calib)] and d["calib_window"] == GEMMA4_TINY.sliding_window
    keep = model.pruned_head.keep_ids
    assert prune_miss_rate(full, keep) == 0.0
    special = (GEMMA4_TINY.pad_id, GEMMA4_TINY.bos_id, *GEMMA4_TINY.eos_ids)
    want, _ = keepset_from_counts(picks, rows, V, special, then=(near, Counter(i for s in seqs for i in s[1:])))
    assert tr.priority == want
    text_keep, _ = keepset_from_counts(Counter(i for s in seqs for i in s[1:]), rows, V, special)
    assert prune_miss_rate(full, torch.tensor(text_keep)) > 0


def test_the_second_tier_orders_what_the_first_leaves():
    ids, filled = keepset_from_counts(Counter({9: 3, 4: 1}), 7, V, always=(0,),
                                      then=(Counter({4: 7, 5: 2, 6: 2}), Counter({6: 9, 8: 1})))
    assert ids == [0, 9, 4, 5, 6, 8, 1] and filled == 1
    with pytest.raises(ValueError, match="wrong tokenizer"):
        keepset_from_counts(Counter({9: 3}), 6, V, then=(Counter({V + 3: 1}),))


def test_refusals(model, tmp_path):
    with pytest.raises(ValueError, match="is read with source=file; this head has source=predicted"):
        PrunedHead(source="predicted", keepset="k.txt")
    with pytest.raises(ValueError, match="lm_head.corpus=x.txt is read with source=corpus"):
        PrunedHead(source="predicted", corpus="x.txt")
    with pytest.raises(ValueError, match="rows=null is only for source=file"):
        PrunedHead(source="predicted", rows=None)
    with pytest.raises(ValueError, match="lm_head.calib_tokens must be"):
        PrunedHead(source="predicted", calib_tokens=10, calib_seq_len=128)
    with pytest.raises(ValueError, match="runners_up must be an integer >= 0"):
        PrunedHead(source="predicted", runners_up=-1)
    with pytest.raises(ValueError, match="leaves no pick in a vocabulary of 512"):
        PrunedHead(source="predicted", runners_up=V, calib=str(_ids_file(tmp_path))).keep_ids(GEMMA4_TINY, model)
    with pytest.raises(ValueError, match="keep_ids needs the model"):
        PrunedHead(source="predicted", calib=str(_ids_file(tmp_path))).keep_ids(GEMMA4_TINY)


def test_without_runners_up_the_picks_are_followed_by_the_texts_ids(model, tmp_path):
    calib = _ids_file(tmp_path)
    kw = dict(rows=200, source="predicted", calib=str(calib), calib_tokens=384, calib_seq_len=128)
    tr = PrunedHead(runners_up=0, **kw)
    seqs = calibration_sequences([i for line in calib.read_text().splitlines() for i in json.loads(line)["ids"]],
                                 128, 384, GEMMA4_TINY.bos_id)
    picks, near = predicted_counts(model, seqs, near=0)
    assert not near
    special = (GEMMA4_TINY.pad_id, GEMMA4_TINY.bos_id, *GEMMA4_TINY.eos_ids)
    want, _ = keepset_from_counts(picks, 200, V, special, then=(Counter(i for s in seqs for i in s[1:]),))
    assert tr.keep_ids(GEMMA4_TINY, model)[0] == want
    with_near, facts = PrunedHead(runners_up=4, **kw).keep_ids(GEMMA4_TINY, model)
    assert with_near != want and facts["runners_up"] == 4 and facts["runners_up_distinct"] > 0

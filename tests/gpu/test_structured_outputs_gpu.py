"""Structured outputs on the GPU, compiled with CUDA graphs: every constrained output follows its
grammar, async scheduling (the masks filled on the mask thread while the engine processes the
last step) gives the synchronous engine's tokens and keeps the next step's forward ahead."""

from __future__ import annotations

import gzip
import os
import re
import shutil
from dataclasses import replace

import pytest
import torch

from compilelm import LLM
from tests.test_structured_outputs import _check_schema_value, _requests, _run

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """(sync, async) compiled engines over the same random weights, SmolLM2's tokenizer (the GPU
    machine has no default model installed: the tokenizer comes from benchmarks/data)."""
    src = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "data", "smollm2_tokenizer")
    tok = tmp_path_factory.mktemp("tokenizer")
    shutil.copy(os.path.join(src, "tokenizer_config.json"), tok)
    with gzip.open(os.path.join(src, "tokenizer.json.gz"), "rb") as f, open(tok / "tokenizer.json", "wb") as out:
        shutil.copyfileobj(f, out)
    kw = dict(tokenizer=str(tok), model_overrides={"num_hidden_layers": 4}, max_model_len=256, num_kv_blocks=256,
              max_num_batched_tokens=256, max_num_seqs=16)
    return tuple(LLM("dummy:smollm2-135m", async_scheduling=a, **kw).engine for a in (False, True))


def test_constrained_and_plain_rows_on_gpu(engines):
    reqs = _requests()
    (sync, _), (asyn, updates) = (_run(e, reqs) for e in engines)
    assert sync == asyn
    # the greedy constrained row samples from the full graph's argmax, its row taken again after
    # the mask; asking for logprobs sends it through the whole sampler (the masked logits in
    # fp32): the same batch, the same logits, the same tokens
    slow = [(rid, p, replace(sp, logprobs=1) if rid == "json0" else sp) for rid, p, sp in reqs]
    assert _run(engines[1], slow)[0]["json0"] == asyn["json0"]
    for i in range(4):
        tokens, text, reason = asyn[f"json{i}"]
        assert reason == "stop", text
        _check_schema_value(text)
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", asyn["regex"][1]) and asyn["regex"][2] == "stop"
    assert asyn["choice"][1] in ("alpha", "beta gamma") and asyn["choice"][2] == "stop"
    assert all(len(asyn[f"plain{i}"][0]) == 12 for i in range(4))
    assert all(runs > k + 1 for k, runs in enumerate(updates[:-2])), updates  # async stayed ahead


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [49152, 32000, 151936, 1000])
def test_mask_kernel_matches_reference(dtype, vocab):
    from compilelm.ops.token_bitmask import mask_logits_rows_, mask_logits_rows_ref

    g = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32 - (1 if vocab == 1000 else 0)  # one case whose masks are narrower than the vocab
    for k, rows in ((1, [3]), (3, [5, 0, 7])):
        masks = torch.randint(-2**31, 2**31 - 1, (k, words), generator=g, dtype=torch.int64).to(torch.int32)
        packed = torch.cat([masks.flatten(), torch.tensor(rows, dtype=torch.int32)]).cuda()
        logits = torch.randn(8, vocab, generator=g).to(dtype).cuda()
        want = mask_logits_rows_ref(logits.clone(), packed, k, words)
        got = mask_logits_rows_(logits, packed, k, words)
        assert got.data_ptr() == logits.data_ptr() and torch.equal(got, want)
        assert torch.isinf(got[rows[0]]).any() and not torch.isinf(got[1]).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [49152, 151936, 1000])
def test_masked_argmax_kernel_matches_reference(dtype, vocab):
    """The greedy rows' fused kernel: the reference's ids at the masked rows (bf16 logits tie
    often at these widths: the first maximum must win), a mask refusing everything gives 0, the
    other ids and the logits are left alone."""
    from compilelm.ops.token_bitmask import masked_argmax_rows_, masked_argmax_rows_ref

    g = torch.Generator().manual_seed(vocab + 1)
    words = (vocab + 31) // 32 - (1 if vocab == 1000 else 0)
    for k, rows in ((1, [3]), (4, [5, 0, 7, 2])):
        masks = torch.randint(-2**31, 2**31 - 1, (k, words), generator=g, dtype=torch.int64).to(torch.int32)
        masks[-1, :] = 0 if k > 1 else masks[-1, :]  # (k = 4: row 2 allows nothing)
        packed = torch.cat([masks.flatten(), torch.tensor(rows, dtype=torch.int32)]).cuda()
        logits = torch.randn(8, vocab, generator=g).to(dtype).cuda()
        before = logits.clone()
        want = masked_argmax_rows_ref(logits, packed, k, words, torch.full((8,), -1, dtype=torch.int64).cuda())
        got = masked_argmax_rows_(logits, packed, k, words, torch.full((8,), -1, dtype=torch.int64).cuda())
        assert torch.equal(got, want) and torch.equal(logits, before)
        assert (got[[r for r in range(8) if r not in rows]] == -1).all()
        if k > 1:
            assert got[2] == 0

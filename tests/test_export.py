"""The Hugging Face format (mingpt_ddp/export/): a trained snapshot of any layout exported, loaded
by transformers with the same logits and generating; a GPT-2 saved by transformers trained on
from its weights (trainer_config.init_from); what GPT-2 cannot hold refused in one line each."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from conftest import run_main, tiny_overrides  # noqa: E402
from test_pipeline import pipeline  # noqa: E402

from mingpt_ddp.errors import ConfigError  # noqa: E402
from mingpt_ddp.export.gpt2 import hf_config  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CHARS = "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"  # Tiny Shakespeare's


def export(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "mingpt_ddp.export", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc, layout",
    [(1, []), (2, ["trainer_config.parallel=fsdp"]), (2, pipeline(2))],
    ids=["one file", "fsdp shards", "pipeline"],
)
def test_an_exported_snapshot_has_the_same_logits_in_transformers_and_generates(
    shakespeare, tmp_path, nproc, layout
):
    from transformers import AutoTokenizer, GPT2LMHeadModel
    from transformers import pipeline as hf_pipeline

    from mingpt_ddp.export.__main__ import main as export_in_process
    from sample import load_model

    args = tiny_overrides(shakespeare, tmp_path, max_steps=2, save_every=2) + layout
    assert run_main(args, nproc=nproc).returncode == 0
    command = ["--snapshot", str(tmp_path / "snapshots"), "--out", str(tmp_path / "hf")]
    if nproc == 1:  # the command as a user runs it; the other layouts in this process (faster)
        result = export(*command)
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.splitlines()[-1].startswith("export | step 2 |"), result.stdout
    else:
        assert export_in_process(command) == 0
    ours, chars, _ = load_model(str(tmp_path / "snapshots"), "cpu")
    theirs = GPT2LMHeadModel.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    text = shakespeare.read_text()[1000:1032]  # spaces, newlines and punctuation
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    assert torch.equal(ids[0], chars.encode(text)) and tokenizer.decode(ids[0]) == text
    with torch.no_grad():
        difference = (ours(ids)[0] - theirs(ids).logits).abs().max().item()
    assert difference <= 1e-5, difference
    if nproc > 1:
        return  # generation once is enough: it depends on the folder, not on the layout
    generate = hf_pipeline("text-generation", model=theirs, tokenizer=tokenizer, device="cpu")
    out = generate("ROMEO:", max_new_tokens=20, do_sample=False)[0]["generated_text"]
    assert out.startswith("ROMEO:") and len(out) == len("ROMEO:") + 20


@pytest.mark.slow
def test_training_starts_from_a_gpt2_saved_by_transformers(shakespeare, tmp_path):
    """A random GPT-2 (transformers' defaults: gelu_new, dropout 0.1) of the tiny shape and the
    corpus's characters, saved by transformers: a run with init_from=the folder computes, at step
    1, the loss transformers computes on the same windows; --from-hf writes the .pt sample.py
    reads."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from mingpt_ddp.export.tokenizer import tokenizer_for

    torch.manual_seed(0)
    shape = dict(n_layer=2, n_head=2, n_embd=32, n_positions=32, vocab_size=len(CHARS))
    theirs = GPT2LMHeadModel(GPT2Config(**shape)).eval()
    folder = tmp_path / "gpt2"
    theirs.save_pretrained(folder)
    tokenizer_for(CHARS, 32).save_pretrained(folder)
    args = tiny_overrides(shakespeare, tmp_path / "run", max_steps=1, log_every=1)
    args += [f"trainer_config.init_from={folder}", "gpt_config.activation=gelu_tanh"]
    args += [f"trainer_config.trace_samples_path={tmp_path / 'starts'}"]
    result = run_main(args)
    assert result.returncode == 0, result.stderr[-3000:]
    starts = json.loads((tmp_path / "starts" / "rank0.jsonl").read_text().splitlines()[0])
    text = shakespeare.read_text()
    windows = torch.tensor([[CHARS.index(c) for c in text[s : s + 33]] for s in starts["starts"]])
    with torch.no_grad():
        logits = theirs(windows[:, :-1]).logits  # (B, T, V)
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())
    records = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    logged = json.loads(records[0])
    assert logged["step"] == 1 and math.isclose(logged["train_loss"], expected.item(), abs_tol=2e-6)
    from mingpt_ddp.export.__main__ import main as export_in_process
    from sample import load_model

    assert export_in_process(["--from-hf", str(folder), "--out", str(tmp_path / "m.pt")]) == 0
    ours, chars, step = load_model(str(tmp_path / "m.pt"), "cpu")  # what sample.py reads
    with torch.no_grad():
        assert (ours(windows[:, :-1])[0] - logits).abs().max() <= 1e-5 and step == 0


@pytest.mark.parametrize(
    "setting, words",
    [
        ({"rotary": True}, "gpt_config.rotary=True: GPT-2 adds learned positions"),
        ({"qk_norm": True}, "gpt_config.qk_norm=True: GPT-2 does not normalise"),
        ({"logit_softcap": 30.0}, "gpt_config.logit_softcap=30.0: GPT-2 does not cap"),
        ({"n_experts": 4}, "gpt_config.n_experts=4: GPT-2's blocks have one MLP"),
    ],
)
def test_what_gpt2_cannot_hold_is_refused_in_one_line(setting, words):
    cfg = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32, **setting}
    with pytest.raises(ConfigError, match=words) as refused:
        hf_config(cfg, CHARS)
    assert "\n" not in str(refused.value)


def test_a_run_of_another_shape_or_vocabulary_is_told_what_to_set(tmp_path):
    from mingpt_ddp.config.model import GPTConfig
    from mingpt_ddp.export.weights import initial_state

    state = {"wte.weight": torch.zeros(len(CHARS), 32)}
    saved = {"n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": len(CHARS), "block_size": 32}
    torch.save({"model": state, "config": {"gpt_config": saved}, "vocab": CHARS}, tmp_path / "m.pt")
    run = GPTConfig(n_layer=4, n_head=2, n_embd=32, vocab_size=len(CHARS), block_size=64)
    with pytest.raises(ConfigError, match="set gpt_config.n_layer=2 data_config.block_size=32"):
        initial_state(str(tmp_path / "m.pt"), run, CHARS)
    with pytest.raises(ConfigError, match="its vocabulary .65 characters. is not this corpus's"):
        initial_state(str(tmp_path / "m.pt"), run, CHARS[:-1])

"""`mdm_lens.sae.export_activations` on the shipped twin: rows equal `generate(cache=hook @ steps(s))` bit
for bit, the four position sets, SAELens' cached-activation layout (and a few steps of SAELens training on
it, with sae-lens), resume after a kill, 2 gloo ranks = 1 process, and typed errors before compute."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mdm_lens import steps
from mdm_lens.errors import ArgumentError, ArgumentTypeError, HookNameError, InputError, SamplerConfigError
from mdm_lens.sae import export_activations
from mdm_lens.sae.export import parse_steps
from mdm_lens.sweep.runner import item_seed, make_batches
from mdm_lens.sweep.store import SweepStore

datasets = pytest.importorskip("datasets")

REPO = Path(__file__).resolve().parents[1]
RESID, Z = "blocks.1.hook_resid_post", "blocks.0.attn.hook_z"
LENGTHS = (6, 6, 6, 8, 8)
GEN = dict(n_steps=4, gen_length=8, block_length=4)   # 2 blocks of 2 steps, 2 commits a step


def _prompts(model, lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(5, model.cfg.d_vocab, (n,), generator=g)
        ids[0] = model.cfg.bos_token_id
        out.append(ids.tolist())
    return out


def _cols(ds) -> dict[str, np.ndarray]:
    """Every column as one numpy array (Array2D columns: [rows, 1, d_in])."""
    ds = ds.with_format("numpy")
    return {c: np.asarray(ds[c]) for c in ds.column_names}


def _assert_same(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for c in a:
        assert a[c].shape == b[c].shape and np.array_equal(a[c], b[c]), c


def _keys(c: dict) -> list[tuple]:
    return list(zip(c["item_id"].tolist(), c["step"].tolist(), c["position"].tolist()))


def test_rows_equal_generate_with_a_cache_bit_for_bit(mdm, tmp_path):
    prompts = _prompts(mdm)
    when = steps(0, 2, -1)
    ds = export_activations(mdm, prompts, [RESID, Z], out=tmp_path / "all", steps=when, positions="all",
                            batch_size=3, seed=5, progress=False, **GEN)
    assert ds.features[RESID].shape == (1, mdm.cfg.d_model) and ds.features[Z].shape == (1, mdm.cfg.d_model)
    got = _cols(ds)
    row = 0
    # the same batch composition: make_batches by length, one generate call per equal-length group
    for batch in make_batches([len(p) for p in prompts], 3, "length"):
        for length in dict.fromkeys(len(prompts[i]) for i in batch):
            group = [i for i in batch if len(prompts[i]) == length]
            out = mdm.generate(torch.tensor([prompts[i] for i in group]), steps=4, gen_length=8, block_length=4,
                               seed=item_seed(5, str(group[0])), cache=[RESID, Z] @ when, progress=False)
            for b, i in enumerate(group):
                for s in (0, 2, 3):
                    n = length + 8
                    sl = slice(row, row + n)
                    assert (got["item_id"][sl] == str(i)).all() and (got["step"][sl] == s).all()
                    assert (got["position"][sl] == np.arange(n)).all()
                    assert (got["block"][sl] == s // 2).all()          # 2 blocks of 2 steps
                    x = out.trajectory.x_steps[s, b]
                    assert (got["token_ids"][sl, 0] == x.numpy()).all()
                    assert (got["is_masked"][sl] == (x == mdm.cfg.mask_token_id).numpy()).all()
                    assert (got["final_token_id"][sl] == out.tokens[b].numpy()).all()
                    assert np.array_equal(got[RESID][sl, 0], out.cache[s][RESID][b].numpy())
                    assert np.array_equal(got[Z][sl, 0], out.cache[s][Z][b].flatten(1).numpy())  # heads flattened
                    row += n
    assert row == len(ds) == sum(LENGTHS) * 3 + 5 * 8 * 3
    # planted: at step 0 exactly the canvas is masked; two positions are left at the last step
    m = got["is_masked"]
    for s, n_left in ((0, 8), (3, 2)):
        ids, counts = np.unique(got["item_id"][m & (got["step"] == s)], return_counts=True)
        assert len(ids) == 5 and (counts == n_left).all()
    assert (got["token_ids"][m, 0] == mdm.cfg.mask_token_id).all()
    assert (got["position"][m] >= np.array([LENGTHS[int(i)] for i in got["item_id"][m]])).all()

    # the other position sets are the matching subsets of "all", row for row
    plen = np.array([LENGTHS[int(i)] for i in got["item_id"]])
    want = {"masked": m, "generated": got["position"] >= plen}    # "unmasked" (= ~is_masked): the gloo test
    for positions, keep in want.items():
        sub = _cols(export_activations(mdm, prompts, [RESID, Z], out=tmp_path / positions, steps=when,
                                       positions=positions, batch_size=3, seed=5, progress=False, **GEN))
        assert len(sub["step"]) == int(keep.sum()) > 0
        _assert_same(sub, {c: v[keep] for c, v in got.items()})


def test_layout_is_saelens_cached_activations(mdm, tmp_path):
    out = tmp_path / "acts"
    export_activations(mdm, _prompts(mdm, (5, 7)), RESID, out=out, steps=[0, -1], n_steps=4, gen_length=4,
                       progress=False)
    ds = datasets.load_from_disk(str(out))              # what SAELens' ActivationsStore calls
    assert ds.features[RESID] == datasets.Array2D(shape=(1, mdm.cfg.d_model), dtype="float32")
    assert ds.features["token_ids"] == datasets.Sequence(datasets.Value("int32"), length=1)
    ds.set_format(type="torch", columns=[RESID, "token_ids"])
    assert ds[0:3][RESID].shape == (3, 1, mdm.cfg.d_model) and ds[0:3]["token_ids"].shape == (3, 1)
    cfg = json.loads((out / "cache_activations_runner_cfg.json").read_text())
    assert (cfg["hook_name"], cfg["d_in"], cfg["context_size"], cfg["training_tokens"]) == (RESID, 128, 1, len(ds))
    man = json.loads((out / "manifest.json").read_text())
    assert man["rows"] == len(ds) == 2 * (4 + 1) and man["items"] == 2   # masked: 4 at step 0, 1 at the last


def test_shard_table_is_the_one_from_dict_builds(mdm):
    from mdm_lens.sae import export_store as ES

    g = np.random.default_rng(0)
    n = 7
    cols = {RESID: g.standard_normal((n, 1, 5)).astype(np.float32), "token_ids": g.integers(0, 99, (n, 1), np.int32),
            "item_id": [f"q{i % 3}" for i in range(n)], "step": g.integers(0, 9, n, np.int32),
            "block": np.zeros(n, np.int32), "position": np.arange(n, dtype=np.int32), "is_masked": g.random(n) < 0.5,
            "final_token_id": g.integers(0, 99, n, np.int32)}
    for dtype in ES.STORE_DTYPES:
        feats = ES.features({RESID: 5}, dtype)
        c = {**cols, RESID: cols[RESID].astype(dtype)}
        ours, ref = ES.to_dataset(c, feats), datasets.Dataset.from_dict(c, features=feats)
        assert ours.features == ref.features and ours.data.table.equals(ref.data.table)
    empty = {k: v[:0] for k, v in cols.items()}
    assert len(ES.to_dataset(empty, ES.features({RESID: 5}, "float32"))) == 0


def test_saelens_training_on_exported_activations_lowers_the_mse(mdm, tmp_path, monkeypatch):
    pytest.importorskip("sae_lens")
    from sae_lens import (CacheActivationsRunnerConfig, LanguageModelSAERunnerConfig, LanguageModelSAETrainingRunner,
                          LoggingConfig, StandardTrainingSAE, StandardTrainingSAEConfig)

    out = tmp_path / "acts"
    ds = export_activations(mdm, _prompts(mdm, (6,) * 24, seed=1), RESID, out=out, positions="masked", n_steps=8,
                            gen_length=8, batch_size=8, progress=False)
    CacheActivationsRunnerConfig(**json.loads((out / "cache_activations_runner_cfg.json").read_text()))
    sae_cfg = StandardTrainingSAEConfig(d_in=mdm.cfg.d_model, d_sae=256)
    torch.manual_seed(0)
    sae = StandardTrainingSAE(sae_cfg)
    acts = torch.tensor(np.asarray(ds[RESID])[:, 0])
    with torch.no_grad():
        before = ((sae.decode(sae.encode(acts)) - acts) ** 2).mean().item()
    cfg = LanguageModelSAERunnerConfig(
        sae=sae_cfg, model_name="mdm-lens/tiny-mdm", hook_name=RESID, dataset_path="unused",
        use_cached_activations=True, cached_activations_path=str(out), context_size=1, training_tokens=2048,
        train_batch_size_tokens=64, store_batch_size_prompts=32, n_batches_in_buffer=256, device="cpu",
        act_store_device="cpu", logger=LoggingConfig(log_to_wandb=False), output_path=None, n_eval_batches=0,
        exclude_special_tokens=False, lr=1e-3, streaming=False)
    # SAELens' runner wants a token dataset beside the cache; with use_cached_activations it reads only the cache
    placeholder = datasets.Dataset.from_dict({"input_ids": [[mdm.cfg.bos_token_id]]})

    def no_model(*a, **k):
        raise AssertionError("SAELens ran the model instead of reading the exported cache")

    for name in ("run_with_cache", "forward"):
        monkeypatch.setattr(mdm, name, no_model)
    trained = LanguageModelSAETrainingRunner(cfg, override_dataset=placeholder, override_model=mdm,
                                             override_sae=sae).run()
    with torch.no_grad():
        after = ((trained.decode(trained.encode(acts)) - acts) ** 2).mean().item()
    assert after < 0.5 * before


def test_a_killed_run_resumes_with_each_row_exactly_once(mdm, tmp_path, monkeypatch):
    prompts = _prompts(mdm, (5, 6, 7, 8, 9, 10))
    kw = dict(steps=steps(0, -1), positions="generated", batch_size=1, progress=False, n_steps=4, gen_length=4)
    fresh = _cols(export_activations(mdm, prompts, RESID, out=tmp_path / "fresh", **kw))
    real = SweepStore.write_batch
    calls = []

    def killed_after_two(self, k, tables, item_ids):
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        calls.append(k)
        return real(self, k, tables, item_ids)

    monkeypatch.setattr(SweepStore, "write_batch", killed_after_two)
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        export_activations(mdm, prompts, RESID, out=out, **kw)
    monkeypatch.setattr(SweepStore, "write_batch", real)
    assert calls == [0, 1] and not (out / "manifest.json").exists()
    assert (out / "parts" / "b000002").is_dir() and not (out / "parts" / "b000002.done").exists()  # cut off
    shutil.rmtree(out / "parts" / "b000002")
    shutil.copytree(out / "parts" / "b000000", out / "parts" / "b000002")   # a stray shard without a marker
    again = _cols(export_activations(mdm, prompts, RESID, out=out, **kw))
    man = json.loads((out / "manifest.json").read_text())
    assert man["ranks"][0]["batches"] == 4 and man["ranks"][0]["items"] == 4
    assert len(again["step"]) == 6 * 2 * 4 and len(set(_keys(again))) == len(again["step"])
    _assert_same(again, fresh)
    with pytest.raises(ArgumentError, match="other arguments"):     # a rerun with other arguments is refused
        export_activations(mdm, prompts, RESID, out=out, **{**kw, "positions": "all"})
    forced = export_activations(mdm, prompts, RESID, out=out, force=True, **{**kw, "positions": "all"})
    assert len(forced) == sum(range(5, 11)) * 2 + 6 * 2 * 4 and len(list(out.glob("data-*.arrow"))) == 6


def test_two_gloo_ranks_give_the_rows_of_one_process(mdm, tmp_path):
    from mdm_lens.zoo import jsonl

    data = tmp_path / "items.jsonl"
    jsonl.export(data, 6, seed=34)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "mdm_lens.cli", "export-activations", "--model", "mdm-lens/tiny-mdm", "--data", str(data), "--hooks",
           f"{RESID},{Z}", "--steps", "every=3", "--positions", "unmasked", "--n-steps", "6", "--gen-length", "6",
           "--batch-size", "2", "--no-progress", "--out", str(tmp_path / "two")]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    one = _cols(export_activations(mdm, data, [RESID, Z], out=tmp_path / "one", steps=parse_steps("every=3"),
                                   positions="unmasked", n_steps=6, gen_length=6, batch_size=2, progress=False))
    two = _cols(datasets.load_from_disk(str(tmp_path / "two")))
    assert sorted(set(one["step"].tolist())) == [0, 3, 5] and len(set(_keys(one))) == len(one["step"]) > 0
    assert not one["is_masked"].any() and (one["token_ids"][:, 0] != mdm.cfg.mask_token_id).all()
    for item in set(one["item_id"].tolist()):     # one commit a step: step s sees the prompt + s positions
        rows = one["item_id"] == item
        n_prompt = int((rows & (one["step"] == 0)).sum())
        assert (one["position"][rows & (one["step"] == 0)] == np.arange(n_prompt)).all()
        assert [int((rows & (one["step"] == s)).sum()) for s in (3, 5)] == [n_prompt + 3, n_prompt + 5]
    _assert_same(two, one)
    man = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert man["world_size"] == 2 and [r["rank"] for r in man["ranks"]] == [0, 1]
    assert sum(r["items"] for r in man["ranks"]) == 6 and all(r["items"] > 0 for r in man["ranks"])


def test_invalid_arguments_raise_typed_errors_before_compute(mdm, arm, tmp_path, monkeypatch):
    def no_generate(*a, **k):
        raise AssertionError("generate ran")

    monkeypatch.setattr(mdm, "generate", no_generate)
    p = _prompts(mdm, (6,))
    out = tmp_path / "never"
    cases = [
        (HookNameError, "blocks.9", dict(hooks="blocks.9.hook_resid_post")),
        (InputError, "per-position", dict(hooks="blocks.0.attn.hook_pattern")),
        (SamplerConfigError, "steps", dict(steps=steps(4))),                 # a 4-step run has steps 0..3
        (SamplerConfigError, "both name step 0", dict(steps=steps(0, -4))),
        (SamplerConfigError, "blocks", dict(steps=steps(blocks=[2]))),       # 2 blocks
        (SamplerConfigError, "cond", dict(steps=steps(0, phases=("uncond",)))),
        (ArgumentTypeError, "steps", dict(steps=4.5)),
        (ArgumentError, "positions", dict(positions="some")),
        (ArgumentTypeError, "hooks", dict(hooks=[])),
        (SamplerConfigError, "sampler_kwargs", dict(sampler_kwargs={"nope": 1})),
        (SamplerConfigError, "alg", dict(sampler_kwargs={"alg": "entropy"})),   # a Dream option on LLaDA
        (InputError, "mask token", dict(data=[[mdm.cfg.bos_token_id, mdm.cfg.mask_token_id]])),
        (InputError, "context", dict(data=[[1] * (mdm.cfg.n_ctx - 4)])),
        (ArgumentError, "store_dtype", dict(store_dtype="bfloat16")),
    ]
    for error, match, kw in cases:
        args = dict(model=mdm, data=p, hooks=RESID, out=out, progress=False, **GEN)
        args.update(kw)
        with pytest.raises(error, match=match):
            export_activations(**args)
        assert not out.exists(), kw
    with pytest.raises(InputError, match="causal"):
        export_activations(arm, p, RESID, out=out, progress=False)
    with pytest.raises(SamplerConfigError, match="nope"):
        parse_steps("0,nope")
    assert parse_steps("first,-1,every=2") == steps("first", -1, every=2) and parse_steps("all") is None

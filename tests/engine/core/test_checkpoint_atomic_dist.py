"""A partial checkpoint is whole or absent after SIGKILL at any point of ``smp.save_checkpoint``.

Each case trains 2 steps, saves ``a`` (complete), trains 2 more and is killed (SIGKILL, via the
``SMP2DS_FAULT_POINT`` hook) at one point of the second save, on 2 real rank processes. A
fresh launch then resumes every directory: weights, optimizer state and ``user_content`` must
come from the same save (never mixed), from the save the crash point implies, and the next save
in that directory must leave no crash leftovers.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.engine.proc_launch import run_script
from tests.engine.workers.api_workers import _raises

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "ckpt_fault.py")
ENV = {"SMP2DS_COMM_TIMEOUT": "15"}

# (fault point, second tag, ranks killed) -> (step `newest` resumes, step tag "b" resumes or None)
CASES = {
    ("files_written", "b", "0,1"): (2, None),
    ("manifest_written", "b", "0"): (2, 4),   # sealed but not renamed: rolled forward as b_partial
    ("renamed", "b", "0"): (2, 4),            # b complete, `newest` still names a
    ("newest_written", "b", "0"): (4, 4),     # a not yet deleted
    ("deleting_old", "b", "0"): (4, 4),       # a half-deleted under a hidden name
    ("files_written", "a", "0,1"): (2, None),  # same tag again: old a intact
    ("old_moved_aside", "a", "0"): (4, None),  # between the two renames: the newer hidden copy
}


def _save(tmp_path, case):
    point, tag2, ranks = case
    name = f"{point}-{tag2}-{ranks.replace(',', '')}"
    ckpt = tmp_path / name
    runs = run_script(SCRIPT, 2, ["save", str(ckpt), tag2],
                      env={**ENV, "ARM_FAULT": point, "SMP2DS_FAULT_RANKS": ranks}, timeout_s=150)
    return str(ckpt), runs


@pytest.mark.slow
def test_sigkill_at_every_point_of_a_save_leaves_a_whole_checkpoint(tmp_path):
    cases = list(CASES)
    with ThreadPoolExecutor(max_workers=3) as pool:
        saved = list(pool.map(lambda c: _save(tmp_path, c), cases))
    for case, (_, runs) in zip(cases, saved):
        killed = {int(r) for r in case[2].split(",")}
        codes = {r.rank: r.returncode for r in runs}
        assert not [r for r in runs if "SAVE-COMPLETED" in r.stdout], case  # every case crashed mid-save
        assert -9 in {codes[k] for k in killed}, (case, codes, [r.stderr[-1500:] for r in runs])
        # a rank not killed (or killed later than its peer) is stopped by the watchdog, not left waiting
        assert set(codes.values()) <= {-9, 75}, (case, codes, [r.stderr[-1500:] for r in runs])
    # One launch verifies every directory against the states its own run recorded.
    runs = run_script(SCRIPT, 2, ["verify", *[s[0] for s in saved]], env=ENV, timeout_s=300)
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr[-3000:] + runs[1].stderr[-3000:]
    results = [json.loads(line[len("RESULT "):]) for line in runs[0].stdout.splitlines()
               if line.startswith("RESULT ")]
    assert len(results) == len(cases)
    for case, result in zip(cases, results):
        newest_step, b_step = CASES[case]
        newest = result["newest"]
        assert newest == {"user_content": newest_step, "model": newest_step, "opt": newest_step}, (case, result)
        if b_step is None:
            assert result["b"]["error"].startswith("SMPCheckpointError: partial checkpoint directory"), result
            assert "b_partial does not exist" in result["b"]["error"]
        else:
            assert result["b"] == {"user_content": b_step, "model": b_step, "opt": b_step}, (case, result)
        left = result["after_next_save"]
        assert not [n for n in left if n.startswith(".smp2ds")], (case, left)
        assert "c_partial" in left and "newest" in left, (case, left)


def checkpoint_checks(tmp: str) -> dict:
    """Rank body: file modes, v3 refusal and shard check, and what resume refuses to load."""
    import json as json_
    import stat

    import torch

    import smdistributed.modelparallel.torch as smp
    from smdistributed.modelparallel.torch import exceptions as E

    os.umask(0o022)
    smp.init({"ddp": True, "shard_optimizer_state": True})
    r, out = smp.rank(), {}
    torch.manual_seed(0)
    model = smp.DistributedModel(torch.nn.Linear(4, 2))
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1))

    @smp.step
    def train_step(model, x):
        model.backward(model(x).sum())

    opt.zero_grad()
    train_step(model, torch.randn(2, 4))
    opt.step()
    ckpt = os.path.join(tmp, "ckpt")
    smp.save_checkpoint(ckpt, "t", model=model, optimizer=opt, user_content={"u": 1})
    smp.save_checkpoint(ckpt, "full.pt", partial=False, model=model, user_content={"u": 2})
    smp.save(opt.local_state_dict(), os.path.join(tmp, "opt"), partial=True, v3=True)
    smp.barrier()
    files = [os.path.join(dp, f) for dp, _, fs in os.walk(tmp) for f in fs]
    out["modes"] = {os.path.relpath(f, tmp): oct(stat.S_IMODE(os.stat(f).st_mode)) for f in files}
    # (3) a sharded optimizer state without v3 would be one file for both shards: refused
    out["no_v3"] = _raises(lambda: smp.save(opt.local_state_dict(), os.path.join(tmp, "bad"), partial=True),
                           E.SMPInvalidArgumentError)
    out["v3_own_shard"] = smp.load(os.path.join(tmp, "opt"), partial=True)["smp2ds"]["rdp_rank"]
    # what an older save without v3 produced: the last writer's shard under the one shared name
    if r == 1:
        torch.save(opt.local_state_dict(), os.path.join(tmp, "shared_0_0.pt"))
    smp.barrier()
    out["other_shard"] = _raises(lambda: smp.load(os.path.join(tmp, "shared"), partial=True),
                                 E.IncompatibleCheckpointRankFoundError)

    # (2) resume refuses incomplete or mismatched checkpoints (no model yet: nothing collective runs)
    def resume(**kw):
        smp.reset()
        return smp.resume_from_checkpoint(ckpt, **kw)

    out["ok"] = resume()
    part = os.path.join(ckpt, "t_partial")
    smp.barrier()
    if r == 0:
        os.rename(os.path.join(part, "optimizer_states_0_0_1.pt"), os.path.join(tmp, "moved.pt"))
    smp.barrier()
    out["missing_opt"] = _raises(lambda: resume(tag="t"), E.MissingCheckpointFilesError)
    out["weights_only"] = resume(tag="t", load_optimizer=False)
    smp.barrier()
    if r == 0:
        os.rename(os.path.join(tmp, "moved.pt"), os.path.join(part, "optimizer_states_0_0_1.pt"))
        with open(os.path.join(part, "model_0_0.pt"), "r+b") as handle:  # same size, one byte changed
            handle.seek(40)
            byte = handle.read(1)
            handle.seek(40)
            handle.write(bytes([byte[0] ^ 0xFF]))
    smp.barrier()
    out["corrupt"] = _raises(lambda: resume(), E.SMPCheckpointError)
    smp.barrier()
    if r == 0:
        with open(os.path.join(part, "model_0_0.pt"), "r+b") as handle:
            handle.seek(40)
            handle.write(byte)
        manifest = os.path.join(part, "smp2ds_manifest.json")
        with open(manifest) as handle:
            data = json_.load(handle)
        data["layout"].update(world_size=4, rdp=4)
        with open(manifest, "w") as handle:
            json_.dump(data, handle)
    smp.barrier()
    out["layout"] = _raises(lambda: resume(), E.IncompatibleCheckpointFoundError)
    out["layout_weights_only"] = resume(load_optimizer=False)
    smp.reset()
    smp.save_checkpoint(ckpt, "noopt", model=model)
    out["saved_without_optimizer"] = _raises(lambda: resume(tag="noopt"), E.MissingCheckpointFilesError)
    # a checkpoint without a manifest (written by SMP) still loads; a missing part is still an error
    smp.barrier()
    if r == 0:
        os.remove(os.path.join(ckpt, "noopt_partial", "smp2ds_manifest.json"))
    smp.barrier()
    out["legacy_missing_opt"] = _raises(lambda: resume(tag="noopt"), E.MissingCheckpointFilesError)
    out["legacy_weights_only"] = _raises(lambda: resume(tag="noopt", load_optimizer=False), Exception)
    smp.barrier()
    return out


@pytest.mark.slow
def test_modes_v3_refusal_and_what_resume_refuses(tmp_path):
    from tests._dist import run_ranks

    res = run_ranks(checkpoint_checks, 2, str(tmp_path), timeout_s=240)
    for r, out in enumerate(res):
        # (4) every checkpoint file honours the umask (022 -> 0644), as torch.save would
        assert out["modes"] and set(out["modes"].values()) == {"0o644"}, out["modes"]
        for name in ("ckpt/newest", "ckpt/full.pt", "ckpt/user_content_full.pt", "ckpt/t_partial/model_0_0.pt",
                     "ckpt/t_partial/smp2ds_manifest.json", "opt_0_0_1.pt"):
            assert name in out["modes"], (name, out["modes"])
        assert out["no_v3"].startswith("smp.save(") and f"rdp_rank {r} of 2" in out["no_v3"]
        assert "without v3=True" in out["no_v3"] and "pass v3=True" in out["no_v3"]
        assert out["v3_own_shard"] == r
        if r == 0:
            assert "holds the optimizer shard of rdp_rank 1 of 2, but this rank is rdp_rank 0 of 2" in out["other_shard"]
        else:
            assert out["other_shard"] == "NO ERROR"
        assert out["ok"] == {"u": 1} and out["weights_only"] == {"u": 1} and out["layout_weights_only"] == {"u": 1}
        if r == 1:
            assert "optimizer_states_0_0_1.pt is missing although the checkpoint's manifest lists it" in out["missing_opt"]
        else:
            assert out["missing_opt"] == "NO ERROR"  # rank 0's own files are all there
        assert "model_0_0.pt does not match the SHA-256 recorded in the manifest" in out["corrupt"]
        assert "sharded over a different data-parallel layout (world_size: saved 4, now 2, rdp: saved 4, now 2)" \
            in out["layout"] and "load_optimizer=False" in out["layout"]
        assert "was saved without optimizer state; load with load_optimizer=False" in out["saved_without_optimizer"]
        assert f"no optimizer state for this rank in {tmp_path}/ckpt/noopt_partial (looked for " \
            f"optimizer_states_0_0_{r}.pt, optimizer_states_0_0.pt)" in out["legacy_missing_opt"]
        assert out["legacy_weights_only"] == "NO ERROR"

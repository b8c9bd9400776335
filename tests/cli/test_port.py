"""``smp2ds port``: an SMP v1 script rewritten into plain PyTorch + DeepSpeed, proven by training the same.

The project's example script (``examples/train_smp_mlp.py``: smp.init, DistributedModel, DistributedOptimizer,
@smp.step with micro-batches, reduce_mean, allgather, save_checkpoint, barrier) is ported for data parallelism with
2 micro-batches, for ZeRO-1 and for sharded data parallelism (ZeRO-3), run by the ``deepspeed`` launcher on 2 CPU
ranks with smdistributed and smp2ds made unimportable, and prints the losses and final-weights digest the unported
script prints under smp2ds (torchrun, same SMP parameters). The tensor-parallel example
(``examples/train_smp_llama_tp.py``: a tiny LLaMA built in ``smp.model_creation(tensor_parallelism=True)``) is
ported for DeepSpeed's AutoTP and trains as the unported script does under smp2ds at tensor_parallel_degree 2, to a
stated tolerance. The rules, the markers, the report, formatting and the exit codes are checked on small scripts
(golden texts for the tensor-parallel and model_creation rules).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from smp2ds.cli import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_smp_mlp.py"
LLAMA_TP = ROOT / "examples" / "train_smp_llama_tp.py"
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
BLOCKED = """import runpy, sys
sys.modules["smdistributed"] = None  # the ported script must not need SMP's package nor smp2ds
sys.modules["smp2ds"] = None
args = sys.argv[1:]  # the deepspeed launcher puts --local_rank=N first
script = next(a for a in args if a.endswith(".py"))
args.remove(script)
sys.argv = [script, *args]
runpy.run_path(script, run_name="__main__")
"""


def _port(tmp_path: Path, source: str, params: dict | None = None, *flags: str) -> tuple[int, Path]:
    script, out = tmp_path / "train.py", tmp_path / "train_deepspeed.py"
    script.write_text(source, encoding="utf-8")
    argv = ["port", str(script), "-o", str(out), "--report", str(tmp_path / "report.txt"), *flags]
    if params is not None:
        (tmp_path / "smp.json").write_text(json.dumps(params), encoding="utf-8")
        argv += ["--config", str(tmp_path / "smp.json")]
    return main(argv), out


def _lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith(("step ", "final weights"))]


def _run_ported(tmp_path: Path, out: Path, *args: str, launcher: str = "deepspeed") -> str:
    """The ported script's standard output, run on 2 CPU ranks with smdistributed and smp2ds unimportable, by the
    ``deepspeed`` launcher or by ``torchrun`` (the same environment for ``deepspeed.init_distributed``; about 10 s
    less on 2 cores: the deepspeed launcher imports DeepSpeed twice and polls its ranks each second)."""
    wrapper = tmp_path / "blocked.py"
    wrapper.write_text(BLOCKED, encoding="utf-8")
    command = (["deepspeed", "--num_gpus", "2"] if launcher == "deepspeed"
               else [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"])
    ported = subprocess.run([*command, str(wrapper), str(out), *args], cwd=tmp_path, env=ENV, capture_output=True,
                            text=True, timeout=300)
    assert ported.returncode == 0, ported.stdout[-3000:] + ported.stderr[-3000:]
    return ported.stdout


def _run_smp(tmp_path: Path, script: Path, params: dict, *args: str) -> str:
    """The unported script's standard output under smp2ds (torchrun, 2 CPU ranks, ``params`` as SageMaker passes
    them)."""
    smp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script), *args],
                         cwd=tmp_path, env={**ENV, "SM_HP_MP_PARAMETERS": json.dumps(params)}, capture_output=True,
                         text=True, timeout=300)
    assert smp.returncode == 0, smp.stdout[-3000:] + smp.stderr[-3000:]
    return smp.stdout


def _config(out: Path) -> dict:
    return json.loads(out.with_suffix(".deepspeed.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("params", [{"ddp": True, "microbatches": 2},
                                    {"ddp": True, "microbatches": 2, "shard_optimizer_state": True}],
                         ids=["dp2-microbatches2", "zero1"])
def test_the_ported_example_trains_like_the_smp_script_under_smp2ds(tmp_path, params):
    """The ported example runs 2 steps and saves (``smp.save_checkpoint`` -> ``engine.save_checkpoint``), then a
    second launch resumes (``smp.resume_from_checkpoint`` -> ``_smp_resume``: weights, Adam's moments, ZeRO-1's
    partitions, the saved user_content giving the step to go on from) and runs 2 more: the losses of all 4 steps and
    the final digest are the unported script's uninterrupted 4 steps under smp2ds, bit for bit."""
    code, out = _port(tmp_path, EXAMPLE.read_text(), params)
    assert code == 1  # smp.state (smp2ds's plan print) is left for a person, marked
    config = _config(out)
    assert config["gradient_accumulation_steps"] == 2
    assert config["zero_optimization"]["stage"] == (1 if params.get("shard_optimizer_state") else 0)
    text = out.read_text()
    assert "smdistributed" not in text.split("def main")[1] and "import smdistributed" not in text
    assert "first = _smp_resume(model, args.resume_dir)[\"steps\"]" in text
    # the deepspeed launcher once (dp 2), torchrun for the rest: the same ranks, 10 s less each
    launcher = "torchrun" if params.get("shard_optimizer_state") else "deepspeed"
    saved = _run_ported(tmp_path, out, "--steps", "2", "--checkpoint-dir", str(tmp_path / "ckpt"), launcher=launcher)
    assert (tmp_path / "ckpt" / "latest").read_text() == "step2"  # DeepSpeed's layout, its newest tag
    resumed = _run_ported(tmp_path, out, "--steps", "2", "--resume-dir", str(tmp_path / "ckpt"), launcher="torchrun")
    smp = _run_smp(tmp_path, EXAMPLE, params, "--steps", "4")
    steps = [line for line in _lines(saved) if line.startswith("step ")]
    assert len(_lines(smp)) == 5 and steps + _lines(resumed) == _lines(smp)


@pytest.mark.slow
def test_the_ported_example_trains_like_the_smp_script_under_sharded_data_parallelism(tmp_path):
    """sdp 2 over 2 ranks: the native config is plain ZeRO-3 (fp32, SMP's sdp gradient clipping 1.0) and the ported
    script prints the unported one's losses and the same weights digest, bit for bit: ``model.state_dict()`` became
    ``_smp_state_dict(model)``, which gathers ZeRO-3's partitions on every rank. The example's parameters (at most
    1,024 elements each) are below ZeRO-3's persistence threshold (100,000 by default: such parameters stay whole
    on every rank after the first forward, and the engine's module.state_dict() would be whole by accident), so the
    test sets stage3_param_persistence_threshold 0: every parameter is partitioned between steps as a large
    model's would be (checked by hand: the former ``model.module.state_dict()`` then prints the digest of no
    weights). The example's other calls (deepspeed.initialize over model.parameters() of the unwrapped model, the
    per-micro-batch engine steps, allgather) need no gather."""
    params = {"ddp": True, "sharded_data_parallel_degree": 2}
    code, out = _port(tmp_path, EXAMPLE.read_text(), params)
    assert code == 1  # smp.state, as above
    config = _config(out)
    assert config["zero_optimization"] == {"stage": 3} and config["gradient_clipping"] == 1.0
    assert not config["fp16"]["enabled"] and not config["bf16"]["enabled"]  # fp32: the gathered values are fp32
    assert "state = _smp_state_dict(model)" in out.read_text()
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    out.with_suffix(".deepspeed.json").write_text(json.dumps(config), encoding="utf-8")
    ported = _run_ported(tmp_path, out, "--steps", "4", launcher="torchrun")
    smp = _run_smp(tmp_path, EXAMPLE, params, "--steps", "4")
    assert len(_lines(smp)) == 5 and _lines(ported) == _lines(smp)


def _losses(output: str) -> list[float]:
    return [float(line.split()[-1]) for line in _lines(output) if line.startswith("step ")]


def _replicas(output: str) -> tuple[float, int]:
    """(the replicas' mean last loss, the tensor-parallel ranks counted) the LLaMA example prints."""
    words = next(line for line in output.splitlines() if line.startswith("replicas' last loss")).split()
    return float(words[3]), int(words[5])


@pytest.mark.slow
def test_the_ported_llama_example_trains_like_the_smp_script_under_autotp(tmp_path):
    """tp 2 at world 2 (``{"ddp": true, "tensor_parallel_degree": 2}``, no prescaled_batch): the tiny LLaMA example
    ported for DeepSpeed's AutoTP (tensor_parallel.autotp_size 2, gloo on CPU ranks; run by torchrun to stay near
    a minute on 2 cores) trains as the unported script does under smp2ds.

    Data: the example picks its rows by rdp_rank, so both tensor-parallel ranks read the same rows in both runs
    (AutoTP asks for that; smp2ds, without prescaled_batch, joins the two identical batches, whose mean loss and
    gradients are those of one batch). Weights: both runs dump ``model.state_dict()`` on rank 0, the full model
    under Hugging Face's names (the port's ``_smp_state_dict`` gathers AutoTP's shards), so the keys and full
    shapes must be equal. Tolerances: tensor parallelism changes the order of floating-point reductions (smp2ds
    and AutoTP split and sum differently), so the runs are not bit-equal: the losses (about 4.8) must agree to
    rtol 1e-5 / atol 1e-6 (measured: 1e-6, the printed precision); AdamW moves a weight by at most about lr = 1e-3
    per step whatever its gradient's size, and normalises tiny gradients, so rounding differences show in the
    weights: they must agree to atol 1e-4, 2.5% of the 4e-3 that 4 steps can move a weight (measured: 8e-6), far
    below the weights' own scale (init std 0.02) that a wrong gather or a shard out of place would show."""
    params = {"ddp": True, "tensor_parallel_degree": 2}
    code, out = _port(tmp_path, LLAMA_TP.read_text(), params)
    assert code == 0  # nothing left for a person
    assert _config(out)["tensor_parallel"] == {"autotp_size": 2}
    text = out.read_text()
    assert "with smp.model_creation" not in text and "    model = LlamaForCausalLM(llama_config())\n" in text
    ported = _run_ported(tmp_path, out, "--steps", "4", "--dump-weights", str(tmp_path / "ported.pt"),
                         launcher="torchrun")  # the deepspeed launcher: the tests above
    smp = _run_smp(tmp_path, LLAMA_TP, params, "--steps", "4", "--dump-weights", str(tmp_path / "smp.pt"))
    assert len(_losses(smp)) == 4
    assert _losses(ported) == pytest.approx(_losses(smp), rel=1e-5, abs=1e-6)
    # SMP's process groups: the rdp group (one rank here) -> AutoTP's data-parallel group, the tp group (both) ->
    # its tensor-parallel group; the world in place of either would double the loss or keep the count
    replicas = [_replicas(smp), _replicas(ported)]
    assert replicas[0][1] == replicas[1][1] == 2 and replicas[1][0] == pytest.approx(replicas[0][0], rel=1e-5)
    assert replicas[0][0] == pytest.approx(_losses(smp)[-1], rel=1e-5)  # one replica: its own last loss
    theirs, ours = torch.load(tmp_path / "smp.pt"), torch.load(tmp_path / "ported.pt")
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    assert ours["model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)  # whole, not AutoTP's (32, 64) shard
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) <= 1e-4


SCRIPT = '''"""An SMP script with comments and an unusual layout."""
import torch
import smdistributed.modelparallel.torch as sm   # the SMP API, under another name


def build():
    return torch.nn.Linear(4,   4)   # odd spacing stays


def main():
    sm.init( )
    net = sm.DistributedModel(build())
    opt = sm.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.1),  # a comment inside the call
    )

    @sm.step
    def train_step(model, x):
        loss = model(x).sum()
        model.backward(loss)
        return loss

    for _ in range(2):
        opt.zero_grad()
        out = train_step(net, torch.ones(4, 4))
        opt.step()
        print(sm.rank(), sm.size(), sm.local_rank(), out.reduce_mean().item())
    sm.barrier()
'''


def test_each_rule_rewrites_and_comments_and_layout_stay(tmp_path, capsys):
    code, out = _port(tmp_path, SCRIPT, {"ddp": True, "microbatches": 2})
    assert code == 0  # nothing left for a person
    text = out.read_text()
    assert "# the SMP API, under another name" not in text  # the import line is replaced ...
    for kept in ("return torch.nn.Linear(4,   4)   # odd spacing stays", "# a comment inside the call",
                 '"""An SMP script with comments and an unusual layout."""'):
        assert kept in text  # ... everything else keeps its text
    for rewritten in ("import deepspeed\n", "import torch.distributed as dist\n", "deepspeed.init_distributed()",
                      "net = build()", "net, opt, _, _ = deepspeed.initialize(",
                      "model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),  # a comment inside the call",
                      "config=_DS_CONFIG)",
                      "out = _smp_step(train_step, net, torch.ones(4, 4))",
                      "print(dist.get_rank(), dist.get_world_size(), int(os.environ.get(\"LOCAL_RANK\", 0)), "
                      "out.reduce_mean().item())", "dist.barrier()", "_MICROBATCHES = 2"):
        assert rewritten in text, rewritten
    assert "@sm.step" not in text and "opt.zero_grad()" not in text and "opt.step()" not in text
    compile(text, str(out), "exec")
    report = (tmp_path / "report.txt").read_text()
    assert "## Rewritten (" in report and "| 11 | `sm.init( )` | `deepspeed.init_distributed()` |" in report
    assert "## Left for a person (0)" in report and "gradient_accumulation_steps 2" in report


def test_pipelines_and_unknown_calls_are_marked_and_listed(tmp_path, capsys):
    source = SCRIPT.replace("    net = sm.DistributedModel(build())",
                            "    with sm.partition(1):\n        layer = build()\n"
                            "    sm.set_partition(layer, 0)\n    net = sm.DistributedModel(build())\n"
                            "    sm.resume_from_checkpoint('/ckpt')")
    code, out = _port(tmp_path, source, {"ddp": True, "pipeline_parallel_degree": 2, "microbatches": 2})
    assert code == 1
    text = out.read_text()
    assert "with sm.partition(1):  # smp2ds port: pipelines: DeepSpeed's PipelineModule" in text
    assert "sm.set_partition(layer, 0)  # smp2ds port: pipelines" in text
    assert "sm.resume_from_checkpoint('/ckpt')  # smp2ds port: resume after deepspeed.initialize" in text
    report = (tmp_path / "report.txt").read_text()
    assert "## Left for a person (" in report and "set_partition" in report and "resume_from_checkpoint" in report
    assert "([how](docs/leaving-smp.md#porting-the-script-smp2ds-port))" in report  # each item links its docs


def test_exit_codes_nothing_to_port_a_parse_error_and_an_existing_output(tmp_path, capsys):
    plain = "import torch\nprint(torch.ones(1))\n"
    code, out = _port(tmp_path, plain)
    assert code == 0 and out.read_text() == plain
    assert "nothing to port" in capsys.readouterr().err
    assert main(["port", str(tmp_path / "train.py"), "-o", str(out)]) == 2  # exists: --overwrite needed
    assert "pass --overwrite" in capsys.readouterr().err
    (tmp_path / "bad.py").write_text("def f(:\n    pass\n", encoding="utf-8")
    assert main(["port", str(tmp_path / "bad.py"), "-o", str(tmp_path / "bad_out.py")]) == 2
    assert re.search(r"bad\.py:\d+:\d+: does not parse", capsys.readouterr().err)
    assert not (tmp_path / "bad_out.py").exists()


TP_SCRIPT = '''import torch
import smdistributed.modelparallel.torch as smp
from transformers import LlamaForCausalLM


def main(config):
    smp.init()
    # built whole: AutoTP shards it
    with smp.model_creation(tensor_parallelism=True):  # SMP's tensor parallelism
        model = LlamaForCausalLM(config)
    model = smp.DistributedModel(model)
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    first = 4 * smp.rdp_rank()
    print(smp.rdp_size(), smp.tp_rank(), smp.tp_size(), smp.dp_rank())
    every = smp.allgather(first, smp.RDP_GROUP)
    group = smp.allgather(first, smp.CommGroup.TP_GROUP)
    world = smp.allgather(first, smp.DP_GROUP)
    state = model.state_dict()
'''

TP_PORTED = '''def main(config):
    deepspeed.init_distributed()
    # built whole: AutoTP shards it
    # SMP's tensor parallelism
    model = LlamaForCausalLM(config)
    model, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), \
lr=1e-3), config=_DS_CONFIG)
    first = 4 * (dist.get_rank() // _TENSOR_PARALLEL)
    print((dist.get_world_size() // _TENSOR_PARALLEL), (dist.get_rank() % _TENSOR_PARALLEL), _TENSOR_PARALLEL, \
smp.dp_rank())  # smp2ds port: with tensor parallelism SMP's dp_rank counts the tensor-parallel ranks, which read \
their own rows; AutoTP needs the same rows on a tensor-parallel group: index the data by rdp_rank
    every = _smp_allgather(first, "rdp")
    group = _smp_allgather(first, "tp")
    world = _smp_allgather(first)
    state = _smp_state_dict(model)
'''


def test_tensor_parallel_rules_golden(tmp_path, capsys):
    """At tp 2 (golden text): ``with smp.model_creation(tensor_parallelism=True)`` around a LLaMA becomes its body
    (the with line's comment kept above it), ``M = smp.DistributedModel(M)`` goes, rdp/tp ranks and sizes follow
    AutoTP's mesh (parenthesised where they stood inside an expression), allgather keeps SMP's group, state_dict
    gathers, and dp_rank (SMP's tensor-parallel ranks read their own rows) is marked and reported."""
    code, out = _port(tmp_path, TP_SCRIPT, {"ddp": True, "tensor_parallel_degree": 2})
    assert code == 1
    text = out.read_text()
    assert text.split("\n\n\n")[-1] == TP_PORTED
    assert "_TENSOR_PARALLEL = 2  # AutoTP's degree" in text and "import contextlib\n" in text
    report = (tmp_path / "report.txt").read_text()
    assert "| 9 | `smp.model_creation(tensor_parallelism=True)` | `(removed: the model is built as it is; AutoTP " \
           "shards the llama model in deepspeed.initialize)` |" in report
    assert "| 11 | `model = smp.DistributedModel(model)` | `(removed: the model is used as it is)` |" in report
    assert "## Left for a person (1)" in report and "line 14: `smp.dp_rank()`" in report
    assert "give --model to check" not in report  # the family was told by the class: llama, which AutoTP shards


CREATION_SCRIPT = '''import torch
import smdistributed.modelparallel.torch as smp
from transformers import AutoModelForCausalLM, GPT2LMHeadModel


def main(config):
    smp.init()
    with smp.model_creation(tensor_parallelism=True):
        gpt2 = GPT2LMHeadModel(config)
    with smp.model_creation(tensor_parallelism=True):
        auto = AutoModelForCausalLM.from_config(config)
    with smp.model_creation(tensor_parallelism=False):
        whole = GPT2LMHeadModel(config)
    with smp.model_creation(tensor_parallelism=True, dtype=torch.bfloat16, fused_softmax=True):
        replaced = GPT2LMHeadModel(config)
    with smp.model_creation(): plain = torch.nn.Linear(4, 4)
'''

GPT2_MARK = ("    with smp.model_creation(tensor_parallelism=True):  # smp2ds port: tensor parallelism: DeepSpeed's "
             "AutoTP refuses the gpt2 family: export the weights (`smp2ds checkpoint export CHECKPOINT --to hf DIR`) "
             "and train that model with data or sharded data parallelism (tensor_parallel_degree 1: drop "
             "tensor_parallel from the DeepSpeed config), or under accelerate (`smp2ds convert --to accelerate`) "
             "if it has a tp_plan\n        gpt2 = GPT2LMHeadModel(config)\n")
SETTINGS_MARK = ("    with smp.model_creation(tensor_parallelism=True, dtype=torch.bfloat16, fused_softmax=True):  "
                 "# smp2ds port: model_creation dtype: torch.set_default_dtype around the construction (the old one "
                 "restored after); model_creation fused_softmax: SMP's distributed transformer settings have no "
                 "DeepSpeed equivalent\n")


def test_model_creation_at_tensor_parallelism_marks_what_autotp_cannot_run(tmp_path, capsys):
    """At tp 2: GPT-2, which DeepSpeed 0.19's AutoTP refuses by name ('AutoTP not supported for model', checked by
    hand on 2 CPU ranks), keeps its with line, marked with the route that works (export, train without tensor
    parallelism or under accelerate); an Auto class does not tell the family (marked); tensor_parallelism=False
    or absent (AutoTP would shard it all the same), dtype and
    the distributed transformer's settings are marked (a one-line with on its line); the DeepSpeed config is still the layout's (autotp_size 2)."""
    code, out = _port(tmp_path, CREATION_SCRIPT, {"ddp": True, "tensor_parallel_degree": 2})
    assert code == 1
    text = out.read_text()
    assert GPT2_MARK in text and SETTINGS_MARK in text
    assert ("    with smp.model_creation(tensor_parallelism=True):  # smp2ds port: tensor parallelism: the class "
            "built here does not tell the model family: drop this with if DeepSpeed's AutoTP shards it") in text
    unmarked = ("# smp2ds port: at tensor_parallel_degree 2 SMP keeps what is built without tensor_parallelism=True "
                "whole, while AutoTP shards the model deepspeed.initialize gets")
    assert f"    with smp.model_creation(tensor_parallelism=False):  {unmarked}" in text
    assert f"    with smp.model_creation(): plain = torch.nn.Linear(4, 4)  {unmarked}" in text  # a one-line with
    report = (tmp_path / "report.txt").read_text()
    assert "## Left for a person (5)" in report and "line 8: `smp.model_creation(tensor_parallelism=True)`: " \
           "tensor parallelism: DeepSpeed's AutoTP refuses the gpt2 family: export the weights" in report
    assert _config(out)["tensor_parallel"] == {"autotp_size": 2}


def test_model_creation_without_tensor_parallelism_becomes_its_body(tmp_path, capsys):
    """At tp 1 (sharded data parallelism here) SMP shards nothing: every model_creation without SMP's other
    arguments becomes its body, whatever the family; dtype and distributed-transformer settings stay marked (SMP
    replaced GPT-2 by its distributed transformer at tp 1 as well)."""
    code, out = _port(tmp_path, CREATION_SCRIPT, {"ddp": True, "sharded_data_parallel_degree": 2})
    assert code == 1
    main_text = out.read_text().split("def main(config):\n")[1]
    assert main_text == ("    deepspeed.init_distributed()\n    gpt2 = GPT2LMHeadModel(config)\n"
                         "    auto = AutoModelForCausalLM.from_config(config)\n    whole = GPT2LMHeadModel(config)\n"
                         + SETTINGS_MARK + "        replaced = GPT2LMHeadModel(config)\n"
                         "    plain = torch.nn.Linear(4, 4)\n")
    assert "## Left for a person (1)" in (tmp_path / "report.txt").read_text()
    assert _config(out)["zero_optimization"] == {"stage": 3} and "tensor_parallel" not in _config(out)


def test_state_dict_with_smp_arguments_is_marked(tmp_path, capsys):
    source = SCRIPT.replace("    sm.barrier()", "    full = net.state_dict(gather_to_rank0=True)\n    sm.barrier()")
    code, out = _port(tmp_path, source, {"ddp": True})
    assert code == 1
    assert ("full = net.state_dict(gather_to_rank0=True)  # smp2ds port: SMP's state_dict arguments have no "
            "DeepSpeed equivalent") in out.read_text()


def test_resume_from_checkpoint_rules_golden(tmp_path, capsys):
    """After the engine exists, each way SMP's resume is called becomes ``_smp_resume`` with the same arguments
    (positional ones by SMP's order, 1.10's ``load_optimizer_states`` renamed); before it, or with an argument
    DeepSpeed has no equivalent for, the call is marked with the reason."""
    calls = ["uc = sm.resume_from_checkpoint('/ckpt')",
             "uc = sm.resume_from_checkpoint('/ckpt', 'step4', False)",
             "sm.resume_from_checkpoint(path='/ckpt', tag=None, strict=False, load_optimizer=False)",
             "sm.resume_from_checkpoint('/ckpt', load_optimizer_states=False)",
             "sm.resume_from_checkpoint('/ckpt', translate_function=fix)",
             "sm.resume_from_checkpoint('/ckpt', load_sharded_optimizer_state=False)"]
    source = SCRIPT.replace("    sm.barrier()", "\n".join(f"    {c}" for c in calls) + "\n    sm.barrier()")
    source = source.replace("    net = sm.DistributedModel(build())",
                            "    early = sm.resume_from_checkpoint('/old')\n    net = sm.DistributedModel(build())")
    code, out = _port(tmp_path, source, {"ddp": True})
    assert code == 1
    text = out.read_text()
    for ported in ("uc = _smp_resume(net, '/ckpt')", "uc = _smp_resume(net, '/ckpt', tag='step4', partial=False)",
                   "_smp_resume(net, '/ckpt', tag=None, strict=False, load_optimizer=False)",
                   "_smp_resume(net, '/ckpt', load_optimizer=False)"):
        assert f"    {ported}\n" in text, ported
    assert ("early = sm.resume_from_checkpoint('/old')  # smp2ds port: resume after deepspeed.initialize: "
            "_smp_resume(engine, path, tag=...)") in text
    assert ("sm.resume_from_checkpoint('/ckpt', translate_function=fix)  # smp2ds port: resume_from_checkpoint "
            "translate_function: translate the state dict by hand") in text
    assert ("sm.resume_from_checkpoint('/ckpt', load_sharded_optimizer_state=False)  # smp2ds port: "
            "resume_from_checkpoint load_sharded_optimizer_state: DeepSpeed loads ZeRO's optimizer partitions whole "
            "or not at all") in text
    report = (tmp_path / "report.txt").read_text()
    assert "checkpoints: the ported script saves and resumes DeepSpeed's layout" in report
    compile(text, str(out), "exec")


RESUME_SCRIPT = '''import json, sys
import torch
import smdistributed.modelparallel.torch as smp


def main():
    smp.init()
    torch.manual_seed(0)
    model = smp.DistributedModel(torch.nn.Linear(4, 2))
    optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1))

    @smp.step
    def train_step(model, x):
        loss = model(x).square().sum()
        model.backward(loss)
        return loss

    def train():
        optimizer.zero_grad()
        train_step(model, torch.ones(2, 4))
        optimizer.step()

    def moment():
        return [optimizer.state[p]["exp_avg"].clone() for p in model.parameters()]

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a, b))

    train()
    smp.save_checkpoint(sys.argv[1], tag="a", partial=True, model=model, optimizer=optimizer, user_content={"k": 1})
    saved, saved_moment = [p.detach().clone() for p in model.parameters()], moment()
    train()
    later = moment()
    full = smp.resume_from_checkpoint(sys.argv[1], tag="a", partial=False)  # weights only
    checks = {"full_weights": same(list(model.parameters()), saved), "full_keeps_moment": same(moment(), later)}
    train()
    later = moment()
    weights_only = smp.resume_from_checkpoint(sys.argv[1], load_optimizer=False)  # tag None: the latest
    checks.update(weights=same(list(model.parameters()), saved), keeps_moment=same(moment(), later))
    content = smp.resume_from_checkpoint(sys.argv[1])
    checks.update(all_moment=same(moment(), saved_moment), content=content, full=full, weights_only=weights_only)
    print(json.dumps(checks))


main()
'''


@pytest.mark.slow
def test_the_resume_rewrite_restores_weights_moments_and_user_content_as_asked(tmp_path):
    """``_smp_resume`` on a real DeepSpeed engine (one rank): a full resume (``partial=False``: SMP's full
    checkpoints hold weights only) and one with ``load_optimizer=False`` restore the saved weights and leave Adam's
    moments as they were; the default restores the moments too; each returns the saved user_content."""
    code, out = _port(tmp_path, RESUME_SCRIPT, {"ddp": True, "microbatches": 1})
    assert code == 0, (tmp_path / "report.txt").read_text()
    (tmp_path / "blocked.py").write_text(BLOCKED, encoding="utf-8")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                          str(tmp_path / "blocked.py"), str(out), str(tmp_path / "ckpt")], cwd=tmp_path, env=ENV,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    checks = json.loads(run.stdout.strip().splitlines()[-1])
    assert checks == {"full_weights": True, "full_keeps_moment": True, "weights": True, "keeps_moment": True,
                      "all_moment": True, "content": {"k": 1}, "full": {"k": 1}, "weights_only": {"k": 1}}


LOAD_SCRIPT = '''import json
import os
import torch
import smdistributed.modelparallel.torch as smp


def main():
    smp.init()
    torch.manual_seed(0)
    model = smp.DistributedModel(torch.nn.Linear(4, 2))
    optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1))
    torch.manual_seed(0)
    reference = torch.nn.Linear(4, 2)  # the same weights, trained by plain PyTorch on the same (every rank's) data
    adam = torch.optim.Adam(reference.parameters(), lr=0.1)

    @smp.step
    def train_step(model, x):
        loss = model(x).square().sum()
        model.backward(loss)
        return loss

    def train(i):
        x = torch.arange(8.0).reshape(2, 4) / (i + 1)
        optimizer.zero_grad()
        train_step(model, x)
        optimizer.step()
        adam.zero_grad()
        reference(x).square().sum().backward()
        adam.step()

    start = model.state_dict()
    train(0)
    train(1)
    model.load_state_dict(start)  # back to the first weights; Adam's moments stay
    reference.load_state_dict(start)
    loaded = all(torch.equal(v, start[k]) for k, v in model.state_dict().items())
    train(2)
    final, want = model.state_dict(), reference.state_dict()
    sent = smp.broadcast({"from": 0}, smp.CommGroup.WORLD) if smp.rank() == 0 else smp.recv_from(0, smp.RankType.WORLD_RANK)
    # one write per line: the two ranks share the pipe, and print's separate writes of text and newline interleave
    os.write(1, (json.dumps({"loaded": loaded, "diff": max((final[k] - want[k]).abs().max().item() for k in want),
                             "sent": sent}) + "\\n").encode())


main()
'''


@pytest.mark.slow
@pytest.mark.parametrize("params", [{"ddp": True, "shard_optimizer_state": True},
                                    {"ddp": True, "sharded_data_parallel_degree": 2}], ids=["zero1", "sdp2"])
def test_load_state_dict_and_broadcast_rewrites_on_two_ranks(tmp_path, params):
    """``_smp_load_state_dict`` puts the whole model back on every rank, ZeRO-1's fp32 partitions and ZeRO-3's
    parameter partitions included (the persistence threshold at 0: every parameter partitioned): the next Adam step
    equals plain PyTorch's from the same weights and moments (without the optimizer's refresh, ZeRO-1 steps from the
    weights it held before the load); ``_smp_broadcast`` / ``_smp_recv_from`` carry rank 0's object to rank 1."""
    code, out = _port(tmp_path, LOAD_SCRIPT, params)
    assert code == 0, (tmp_path / "report.txt").read_text()
    config = _config(out)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    config["gradient_clipping"] = 0.0  # SMP's sdp clips at 1.0; the reference does not
    out.with_suffix(".deepspeed.json").write_text(json.dumps(config), encoding="utf-8")
    results = [json.loads(line) for line in _run_ported(tmp_path, out, launcher="torchrun").splitlines()
               if line.startswith("{")]
    assert len(results) == 2
    for result in results:
        assert result["loaded"] and result["diff"] <= 1e-6 and result["sent"] == {"from": 0}, result


def test_process_group_rules_golden(tmp_path, capsys):
    """Without tensor parallelism SMP's world, data-parallel and reduced-data-parallel groups are every rank; with it
    the world and dp groups still are (dp counts the tensor-parallel ranks), rdp and tp are AutoTP's groups once
    deepspeed.initialize has built them; a group called before that, or a pipeline's, is marked."""
    calls = "\n".join(f"    g{i} = sm.{name}()" for i, name in enumerate(
        ["get_world_process_group", "get_dp_process_group", "get_rdp_process_group", "get_tp_process_group"]))
    source = SCRIPT.replace("    sm.barrier()", calls + "\n    sm.barrier()")
    for sub in "abc":
        (tmp_path / sub).mkdir()
    _, out = _port(tmp_path / "a", source, {"ddp": True})
    text = out.read_text()
    assert "    g0 = dist.group.WORLD\n    g1 = dist.group.WORLD\n    g2 = dist.group.WORLD\n" in text
    assert "    g3 = sm.get_tp_process_group()  # smp2ds port: " in text  # a group of one rank: by hand
    _, out = _port(tmp_path / "b", source.replace("    net = sm.DistributedModel(build())",
                                            "    early = sm.get_rdp_process_group()\n    net = sm.DistributedModel(build())"),
                   {"ddp": True, "tensor_parallel_degree": 2})
    text = out.read_text()
    assert ("    g0 = dist.group.WORLD\n    g1 = dist.group.WORLD\n"
            "    g2 = deepspeed.utils.groups.get_data_parallel_group()\n"
            "    g3 = deepspeed.utils.groups.get_tensor_model_parallel_group()\n") in text
    assert "    early = sm.get_rdp_process_group()  # smp2ds port: " in text
    _, out = _port(tmp_path / "c", source, {"ddp": True, "pipeline_parallel_degree": 2, "partitions": 2})
    assert "    g0 = sm.get_world_process_group()  # smp2ds port: " in out.read_text()


LOAD_TP_SCRIPT = '''import json
import os
import torch
from transformers import LlamaConfig, LlamaForCausalLM
import smdistributed.modelparallel.torch as smp


def main():
    smp.init()
    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=True):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False))
    model = smp.DistributedModel(model)
    optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))

    @smp.step
    def train_step(model, ids):
        loss = model(input_ids=ids, labels=ids).loss
        model.backward(loss)
        return loss

    ids = torch.arange(16).reshape(2, 8) % 64
    start = model.state_dict()
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        losses.append(train_step(model, ids).reduce_mean().item())
        optimizer.step()
        if len(losses) == 2:
            model.load_state_dict(start)  # back to the first weights, every AutoTP shard its part
    os.write(1, (json.dumps({"losses": losses}) + "\\n").encode())  # one write: the ranks share the pipe


main()
'''


@pytest.mark.slow
def test_load_state_dict_under_autotp_gives_each_shard_its_part(tmp_path):
    """tp 2 with AutoTP: after two Adam steps the whole start state dict is loaded back; the third step's loss (its
    forward runs before that step's update) equals the first step's, so every shard holds its part of the loaded
    weights again (a shard left as trained, or given the wrong rows, changes the loss)."""
    code, out = _port(tmp_path, LOAD_TP_SCRIPT, {"ddp": True, "tensor_parallel_degree": 2})
    assert code == 0, (tmp_path / "report.txt").read_text()
    result = [json.loads(line) for line in _run_ported(tmp_path, out, launcher="torchrun").splitlines()
              if line.startswith("{")][0]
    first, second, third = result["losses"]
    assert third == pytest.approx(first, rel=1e-6) and abs(second - first) > 1e-4


def test_nested_smp_names_send_and_load_state_dict_arguments_are_marked(tmp_path, capsys):
    """``smp.nn.X(...)``, ``smp.amp.GradScaler()`` and a bare ``smp.nn.X`` are marked (nothing of SMP's is left
    unmarked); with ``smp.send`` in the script ``recv_from`` could match a send or a broadcast, so both are marked;
    ``load_state_dict`` with SMP's own arguments is marked."""
    source = SCRIPT.replace("    sm.barrier()", "\n".join([
        "    head = sm.nn.DistributedTransformerLMHead(num_layers=2)",
        "    scaler = sm.amp.GradScaler()",
        "    cls = sm.nn.DistributedTransformer",
        "    sm.send(1, 1, sm.RankType.WORLD_RANK)",
        "    x = sm.recv_from(0, sm.RankType.WORLD_RANK)",
        "    net.load_state_dict({}, same_partition_load=True)",
        "    sm.barrier()"]))
    code, out = _port(tmp_path, source, {"ddp": True})
    assert code == 1
    text = out.read_text()
    for line, why in [("head = sm.nn.DistributedTransformerLMHead(num_layers=2)", "smp.nn modules have no DeepSpeed"),
                      ("scaler = sm.amp.GradScaler()", "smp.amp.GradScaler: DeepSpeed scales fp16 losses itself"),
                      ("cls = sm.nn.DistributedTransformer", "sm.nn: no rewrite here"),
                      ("sm.send(1, 1, sm.RankType.WORLD_RANK)", "sm.send has no rewrite here"),
                      ("x = sm.recv_from(0, sm.RankType.WORLD_RANK)", "sm.recv_from has no rewrite here"),
                      ("net.load_state_dict({}, same_partition_load=True)", "SMP's load_state_dict arguments")]:
        assert f"    {line}  # smp2ds port: " in text and why in text.split(line)[1].splitlines()[0], line
    assert "sm." not in "".join(line.split("#")[0] for line in text.splitlines() if "# smp2ds port:" not in line)


class _FakeWorld:
    """torch.distributed for the port's helpers: rank ``me`` of ``size``, all_gather_object filling in each rank's
    own number."""

    def __init__(self, me: int, size: int) -> None:
        self.me, self.size = me, size

    def get_rank(self) -> int:
        return self.me

    def get_world_size(self) -> int:
        return self.size

    def all_gather_object(self, gathered: list, obj: object) -> None:
        gathered[:] = list(range(self.size))


def test_allgather_keeps_smp_groups_on_autotp_mesh(tmp_path, capsys):
    """``_smp_allgather`` at world 4, tp 2 (DeepSpeed's mesh: tensor-parallel groups {0, 1} and {2, 3}): rank 1's
    RDP_GROUP is ranks 1 and 3, its TP_GROUP ranks 0 and 1, the world all four."""
    _, out = _port(tmp_path, TP_SCRIPT, {"ddp": True, "tensor_parallel_degree": 2})
    helpers = out.read_text().split("from transformers import LlamaForCausalLM\n")[1].split("\ndef main")[0]
    namespace: dict = {"contextlib": contextlib, "os": os, "torch": torch, "__file__": str(out), "dist": _FakeWorld(1, 4)}
    exec(compile(helpers, str(out), "exec"), namespace)  # the helper block the port wrote, as it wrote it
    gather = namespace["_smp_allgather"]
    assert gather("x", "rdp") == [1, 3] and gather("x", "tp") == [0, 1] and gather("x") == [0, 1, 2, 3]


def test_smps_gpt2_script_ports_with_the_distributed_transformer_and_pipelines_left_marked(tmp_path, capsys):
    """The SMP-style GPT-2 script (``tests/scripts/gpt2_transformer/train_gpt_simple.py``, written like SMP's GPT-2
    example) at tp 2: the rest is rewritten (init, ranks, barrier, DistributedModel + DistributedOptimizer ->
    deepspeed.initialize, @smp.step, state_dict, save_checkpoint) and the result is valid Python; the distributed
    transformer's model_creation, the pipeline partitioning, the activation-checkpointing calls, the resume and
    smp.save / smp.load are marked and listed, exit 1."""
    script = ROOT / "tests" / "scripts" / "gpt2_transformer" / "train_gpt_simple.py"
    code, out = _port(tmp_path, script.read_text(), {"ddp": True, "tensor_parallel_degree": 2, "microbatches": 2})
    assert code == 1
    ported = out.read_text()
    compile(ported, str(out), "exec")
    assert "import smdistributed" not in ported and "deepspeed.initialize(model=model" in ported
    report = (tmp_path / "report.txt").read_text()
    manual = report.split("## Left for a person")[1].split("## What differs")[0]
    for needed in ("smp.model_creation(", "SMP's distributed transformer settings", "smp.set_partition(",
                   "smp.set_activation_checkpointing(", "smp.save(", "smp.load("):
        assert needed in manual, needed
    rewritten = report.split("## Rewritten")[1].split("## Left for a person")[0]
    assert "_smp_state_dict(model)" in rewritten and "model.save_checkpoint(args.model_dir" in rewritten
    # the full-model save and its resume pair up in DeepSpeed's layout: module only, SMP's full checkpoint holds no
    # optimizer state
    assert '_smp_resume(model, args.model_dir, tag="fullmodel.pt", partial=False)' in ported
    assert "checkpoints: the ported script saves and resumes DeepSpeed's layout" in report
    assert "give --model-type" not in report  # port has no such flag: the note speaks of the script
    capsys.readouterr()

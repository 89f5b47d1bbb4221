"""``offload estimate``: the ZeRO formulas by hand, the engine's own buffers by hand, and the
prediction against the peak resident memory of a real stage-3 run (another process)."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from offload.cli import main
from offload.plan.estimate import EstimateInput, estimate, gpt_shapes, shapes_from_count, zero_formula_bytes
from tests import child_pythonpath

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "offload", "estimate_worker.py")
PSI = 64 * 4 * 1000  # 256,000 elements: splits evenly over 1, 2 and 4 ranks, no padding


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("c", [2, 4])
def test_zero_formulas(world, c):
    """The ZeRO paper's model states per device: (2+2+K) Psi, 2 Psi + 2 Psi + K Psi / N, 2 Psi + (2+K) Psi / N,
    (2+2+K) Psi / N with fp16 (K = 12); fp32 doubles the 2s."""
    expected = {0: 2 * c * PSI + 12 * PSI, 1: c * PSI + c * PSI + 12 * PSI // world,
                2: c * PSI + c * PSI // world + 12 * PSI // world, 3: (c + c + 12) * PSI // world}
    for stage, value in expected.items():
        assert zero_formula_bytes(stage, PSI, world, c) == value
    rows = estimate(EstimateInput(shapes=shapes_from_count(PSI), world_size=world, compute_bytes=c)).rows
    for r in rows:  # nothing offloaded: the paper's figure, on the device (at stage 3 with the largest param)
        if r.optimizer == r.param == "none":
            gathered = 2 * c * (PSI // 96) if r.stage == 3 else 0
            assert (r.zero_device_bytes, r.zero_host_bytes, r.zero_nvme_bytes) == (expected[r.stage] + gathered, 0, 0)


def _deepspeed(stage: int, param: str, *, psi: int, largest: int, ranks: int) -> tuple[int, int]:
    """The oracle: DeepSpeed's estimate_zero2_model_states_mem_needs (stages 1-2) and
    estimate_zero3_model_states_mem_needs (zero_init) with cpu_offload, for fp16/bf16, one node of ``ranks``
    GPUs, without the 1.5 additional_buffer_factor: (per GPU, per CPU), the node's CPU bytes here per rank."""
    if stage < 3:
        return 2 * psi, 16 * psi // ranks
    if param == "cpu":
        return 4 * largest, 18 * psi // ranks
    return 4 * largest + 2 * psi // ranks, 16 * psi // ranks


@pytest.mark.parametrize("world", [1, 2, 4])
def test_the_zero_formula_is_the_rows_own(world, capsys):
    """Issue 41: the ZeRO formula column held one figure per stage, whatever the row offloaded. It is the
    row's: the ZeRO model states placed as the row places them, as DeepSpeed's memory estimators place them
    (its rows with the optimizer in host memory, bf16, agree exactly); the states offloaded to NVMe are the
    row's NVMe figure; and the table shows each row's figures."""
    largest = PSI // 4
    est = estimate(EstimateInput(shapes=shapes_from_count(PSI, largest_layer=largest), world_size=world,
                                 compute_bytes=2))
    for stage, optimizer, param in [(1, "cpu", "none"), (2, "cpu", "none"), (3, "cpu", "none"), (3, "cpu", "cpu")]:
        r = est.row(stage=stage, optimizer=optimizer, param=param)
        assert (r.zero_device_bytes, r.zero_host_bytes) == _deepspeed(stage, param, psi=PSI, largest=largest,
                                                                      ranks=world), r
    n3 = est.row(stage=3, optimizer="nvme", param="nvme")  # the states and the param shards on NVMe
    assert (n3.zero_device_bytes, n3.zero_host_bytes, n3.zero_nvme_bytes) == (4 * largest, 4 * PSI // world,
                                                                             14 * PSI // world)
    n1 = est.row(stage=1, optimizer="nvme")
    assert (n1.zero_device_bytes, n1.zero_host_bytes, n1.zero_nvme_bytes) == (2 * PSI, 4 * PSI // world,
                                                                             12 * PSI // world)
    assert len({(r.zero_device_bytes, r.zero_host_bytes) for r in est.rows if r.stage == 3}) == 9
    assert main(["estimate", "--params", str(PSI), "--largest-layer", str(largest), "--dtype", "bf16",
                 "--world-size", str(world), "--no-baseline", "--gpu-gib", "80", "--host-gib", "64"]) == 0
    head, cells = _table(capsys.readouterr().out)
    col = {name: i for i, name in enumerate(head)}
    for r, row in zip(est.rows, cells):
        assert row[:3] == [str(r.stage), r.optimizer, r.param]
        assert float(row[col["ZeRO device GiB"]]) == round(r.zero_device_bytes / (1 << 30), 2)
        assert float(row[col["ZeRO host GiB"]]) == round(r.zero_host_bytes / (1 << 30), 2)


def test_stage3_without_offload_is_zero3_plus_the_fp32_gradient_accumulators():
    """Stage 3, nothing offloaded, two ranks, bf16: param shards c Psi/N, fp32 master + moments 12 Psi/N and
    this engine's fp32 gradient accumulators 4 Psi/N; gathered units and gradient buffers come on top."""
    shapes = shapes_from_count(PSI, largest_layer=PSI // 4)
    row = estimate(EstimateInput(shapes=shapes, world_size=2, compute_bytes=2)).row(stage=3)
    parts = {what: b for what, _, b in row.parts}
    assert parts["param shards"] == 2 * PSI // 2
    assert parts["fp32 master + moments"] == 12 * PSI // 2
    assert parts["fp32 gradient accumulators"] == 4 * PSI // 2
    assert parts["gathered units (persistent + live)"] == 2 * PSI  # max_live 1e9: every unit may stay gathered
    assert parts["unit gradient buffers"] == 2 * (PSI // 4 + PSI // 4)  # the largest unit + autograd's grad of it
    assert row.host_bytes == 0 and row.nvme_bytes == 0
    assert row.device_bytes == sum(parts.values())


def test_nvme_rows_by_hand():
    """fp32, one rank, 10 Mi elements in units of 1 Mi: sub-groups of 4 Mi (the offload cap), 3 of them.
    Stage 2, optimizer nvme: flat params and grads 4 + 4 bytes per element on the device; host: the fp32
    grads (4 B) and buffer_count (4) state blocks, here all 3 (12 B x 4 Mi, 12 B x 4 Mi, 12 B x 2 Mi);
    NVMe: 12 B per element. Stage 3 with params on NVMe too: 5 shard segments of 4 MiB in host memory."""
    n, mi = 10 << 20, 1 << 20
    inp = EstimateInput(shapes=shapes_from_count(n, largest_layer=mi), compute_bytes=4)
    est = estimate(inp)
    row = est.row(stage=2, optimizer="nvme")
    assert row.device_bytes == 8 * n + 2 * 4 * mi  # + backward's scratch: 2 x the largest param
    assert row.host_bytes == 4 * n + 12 * n
    assert row.nvme_bytes == 12 * n
    row3 = est.row(stage=3, optimizer="nvme", param="nvme")
    assert row3.host_bytes == 4 * n + 12 * n + 5 * 4 * mi
    assert row3.nvme_bytes == 12 * n + 4 * n
    assert est.row(stage=3, optimizer="cpu", param="cpu").host_bytes == 4 * n + 12 * n + 4 * n


def _measured(opt_device: str, param_device: str, workdir: str) -> dict:
    env = dict(os.environ, PYTHONPATH=child_pythonpath(ROOT))
    proc = subprocess.run([sys.executable, WORKER, opt_device, param_device, workdir, "1", "1536"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("opt_device,param_device", [("cpu", "cpu"), ("nvme", "nvme")])
def test_estimate_within_ten_percent_of_a_real_runs_peak(tmp_path, opt_device, param_device):
    """A one-block GPT of width 1536 (~30M parameters) built under init_context trains two steps in another
    process; its VmHWM is within 10% of the estimate for its config, given the process's own memory before
    the model."""
    got = _measured(opt_device, param_device, str(tmp_path))
    shapes = gpt_shapes(vocab_size=64, n_layer=1, n_embd=1536, n_head=4, seq=16, batch=2)
    row = estimate(EstimateInput.from_config(got["config"], shapes, baseline_bytes=got["baseline"]),
                   stages=[3]).row(stage=3, optimizer=opt_device, param=param_device)
    assert abs(row.process_bytes - got["peak"]) / got["peak"] < 0.10, (row.process_bytes, got["peak"], row.parts)


def test_cli_table_json_and_bad_input(capsys):
    assert main(["estimate", "--params", "2e9", "--no-baseline", "--detail", "3,nvme,nvme"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("2,000,000,000 parameters")
    assert len(_table(out)[1]) == 18  # stages 0-2 x 3 optimizer places, stage 3 x 9
    assert "fp32 master + moments" in out
    assert main(["estimate", "--gpt", "n_layer=2,n_embd=64,vocab_size=100", "--seq", "8", "--json", "--stage", "3"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 9 and {r["stage"] for r in rows} == {3}
    assert all(r["process_bytes"] == r["device_bytes"] + r["host_bytes"] for r in rows)
    assert main(["estimate", "--params", "lots"]) == 2
    assert "not a count of parameters" in capsys.readouterr().err
    assert main(["estimate", "--gpt", "n_layer=2"]) == 2


def test_staging_and_rollback_copies_by_hand():
    """Stages 0-2 with the state offloaded: a GPU model's updates go through a host staging buffer
    (c bytes per element of the partition), and offload.overlap_step ("auto" on a GPU) keeps
    rollback copies of the state blocks (12 bytes per element, here of all 3 sub-groups: 120 MiB
    fit in the share of memory the engine gives them). bf16, 10 Mi elements, sub-groups of 4 Mi."""
    n, mi = 10 << 20, 1 << 20
    base = EstimateInput(shapes=shapes_from_count(n, largest_layer=mi), compute_bytes=2)

    def parts(inp, optimizer="cpu", stage=1):
        return {what: b for what, _, b in estimate(inp).row(stage=stage, optimizer=optimizer).parts}

    on_cpu = parts(base)
    assert "param staging (compute dtype)" not in on_cpu and "rollback copies (offload.overlap_step)" not in on_cpu
    gpu = parts(dataclasses.replace(base, gpu=True))
    assert gpu["param staging (compute dtype)"] == 2 * n
    assert gpu["rollback copies (offload.overlap_step)"] == 12 * n
    assert estimate(dataclasses.replace(base, gpu=True)).row(stage=1, optimizer="cpu").host_bytes == \
        estimate(base).row(stage=1, optimizer="cpu").host_bytes + 2 * n + 12 * n
    serial = parts(dataclasses.replace(base, gpu=True, overlap_step=False))
    assert serial["param staging (compute dtype)"] == 2 * n and "rollback copies (offload.overlap_step)" not in serial
    nvme = parts(dataclasses.replace(base, gpu=True), optimizer="nvme")  # nvme undoes by re-reading: no copies
    assert nvme["param staging (compute dtype)"] == 2 * n and "rollback copies (offload.overlap_step)" not in nvme
    dpu = parts(dataclasses.replace(base, delayed_update=True))  # on the CPU too; no overlap beside it
    assert dpu["param staging (compute dtype)"] == 2 * n and "rollback copies (offload.overlap_step)" not in dpu
    for inp in (base, dataclasses.replace(base, gpu=True)):
        none = parts(inp, optimizer="none")
        assert "param staging (compute dtype)" not in none
        stage3 = {what for what, _, _ in estimate(inp).row(stage=3, optimizer="cpu", param="cpu").parts}
        assert "param staging (compute dtype)" not in stage3  # stage 3 writes the shards directly


def test_from_config_reads_the_overlap_and_delayed_keys():
    shapes = shapes_from_count(PSI)
    cfg = {"train_batch_size": 1, "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
           "offload": {"overlap_step": False, "delayed_update": True}}
    inp = EstimateInput.from_config(cfg, shapes, gpu=True)
    assert (inp.gpu, inp.overlap_step, inp.delayed_update) == (True, False, True)


def _table(out: str) -> tuple[list[str], list[list[str]]]:
    """The header's column names and the rows' cells (the verdict and the mark as one cell each)."""
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("stage "))
    starts = [i for i, ch in enumerate(lines[at + 1]) if ch == "-" and (i == 0 or lines[at + 1][i - 1] == " ")]
    def cells(line):
        return [line[a:b].strip() for a, b in zip(starts, starts[1:] + [len(line) + 1])]
    end = lines.index("", at)
    rows = [cells(line) for line in lines[at + 2:end]]
    return cells(lines[at]), rows


@pytest.mark.parametrize("gpu", [False, True])
def test_every_row_has_a_verdict_against_the_given_memories(capsys, gpu):
    """--host-gib 20 --nvme-gib 10 (and --gpu-gib 24): a row fits when each of its printed figures
    is within its memory (without a GPU device and host share host memory: no device column)."""
    extra = ["--gpu-gib", "24"] if gpu else ["--no-gpu"]
    assert main(["estimate", "--params", "1B", "--no-baseline", "--host-gib", "20", "--nvme-gib", "10", *extra]) == 0
    out = capsys.readouterr().out
    head, rows = _table(out)
    assert ("device GiB" in head) == gpu and len(rows) == 18
    col = {name: i for i, name in enumerate(head)}
    fits = 0
    for row in rows:
        need = {"host": float(row[col["host GiB"]]), "NVMe": float(row[col["NVMe GiB"]])}
        if gpu:
            need["GPU"] = float(row[col["device GiB"]])
        have = {"host": 20, "NVMe": 10, "GPU": 24}
        short = [what for what in need if need[what] > have[what] + 0.005]
        verdict = row[col["fits"]]
        assert (verdict == "yes") == (not short), row
        assert all(f"{what} +" in verdict for what in short), row
        fits += not short
    assert 0 < fits < len(rows)  # the limits chosen so that the verdicts differ, NVMe's too
    assert any("NVMe +" in row[col["fits"]] for row in rows)
    assert f"{fits} of 18 rows fit" in out


def test_the_config_row_is_marked_and_the_smallest_change_that_fits_is_named(capsys, tmp_path):
    """Stage 2 with the optimizer in host memory, 2 ranks, does not fit 24 GiB: its row alone is marked, and
    the change named is a fitting row no row with fewer changed settings beats; the daemon's quota
    and pool follow for it."""
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_batch_size": 2, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu"}}}))
    assert main(["estimate", "--params", "1B", "--no-baseline", "--no-gpu", "--host-gib", "24", "--nvme-gib", "100",
                 "--config", str(config), "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    head, rows = _table(out)
    marked = [r for r in rows if r[-1] == "<- the config"]
    assert [r[:3] for r in marked] == [["2", "cpu", "none"]] and marked[0][-2].startswith("no: host +")
    assert "the config (stage 2, offload_optimizer cpu, offload_param none) does not fit" in out
    line = next(x for x in out.splitlines() if x.startswith("the smallest change that fits: "))
    chosen = line.rpartition("(")[2].rstrip(")").replace(",", "").split()  # stage S offload_optimizer O offload_param P
    key = [chosen[1], chosen[3], chosen[5]]
    by_key = {tuple(r[:3]): r for r in rows}
    assert by_key[tuple(key)][-2] == "yes"
    changed = sum(a != b for a, b in zip(key, ["2", "cpu", "none"]))
    assert all(r[-2] != "yes" for r in rows if sum(a != b for a, b in zip(r[:3], ["2", "cpu", "none"])) < changed)
    daemon = next(x for x in out.splitlines() if x.startswith("through a node daemon"))
    quota = int(daemon.split("sessions.default_quota_bytes >= ")[1].split()[0])
    pool = int(daemon.split("pool.capacity_bytes >= ")[1].split()[0])
    sessions = int(daemon.split("; ")[1].split()[0])
    assert quota > 0 and 2 * quota <= pool <= 2 * sessions * quota and "for 2 rank(s)" in daemon


@pytest.mark.parametrize("machine", [["--no-gpu"], ["--gpu-gib", "80", "--host-gib", "256"]])
def test_no_repeated_log_lines(caplog, machine):
    """Issue 41: asked about a GPU machine the estimate logged the rollback copies' budget once per row of
    stages 0-2 with offload_optimizer cpu (and "overlap_step auto: off" once per other row)."""
    caplog.set_level("INFO")
    assert main(["estimate", "--params", "7B", "--no-baseline", *machine]) == 0
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == len(set(messages)), messages


def _json_rows(capsys, *argv: str) -> dict[tuple, dict]:
    assert main(["estimate", *argv, "--json"]) == 0
    return {(r["stage"], r["optimizer"], r["param"]): r for r in json.loads(capsys.readouterr().out)}


def _part(row: dict, prefix: str) -> int:
    return sum(n for what, _, n in row["parts"] if what.startswith(prefix))


def test_host_gib_figures_come_from_the_given_memory(capsys, monkeypatch):
    """Issue 41: with --host-gib every host-memory figure comes from that number, none from this machine:
    whatever MemAvailable says here, the rows are the same; the budget the engine takes from MemAvailable
    (1/FREE_SHARE of it, over --world-size ranks on the node) is that of the memory given: the overlapped
    step's rollback copies (stage 1, cpu, 2B parameters on a GPU: copies of 48 MiB state blocks) and the
    NVMe window (stage 2, nvme: blocks beside the resident 4-byte accumulators) fill it to within a block,
    and gradient_tier auto (stage 3, nvme) sends the accumulators to NVMe where they exceed it."""
    from offload.plan import budget
    from offload.plan.memory import GRADS_ON_NVME_PART, OFFLOAD_SUB_GROUP_CAP, WINDOW_PART

    psi, gib = 2_000_000_000, 1 << 30
    block = 12 * OFFLOAD_SUB_GROUP_CAP
    base = ["--params", "2B", "--no-baseline", "--gpu-gib", "80"]
    seen = []
    for here in (1 << 20, 1 << 50):  # this machine's MemAvailable: absurdly small, absurdly large
        monkeypatch.setattr(budget, "available_bytes", lambda here=here: here)
        seen.append(_json_rows(capsys, *base, "--host-gib", "24"))
    assert seen[0] == seen[1]
    monkeypatch.setattr(budget, "available_bytes", lambda: 1 << 50)
    for host_gib, ranks in ((12, 1), (24, 1), (48, 1), (48, 2)):
        rows = _json_rows(capsys, *base, "--host-gib", str(host_gib), "--world-size", str(ranks))
        share = host_gib * gib // budget.FREE_SHARE // ranks
        partition = psi // ranks
        states = 12 * partition

        def fills(room: int, held: int, floor: int) -> bool:  # as many blocks as fit, at least the floor, at most all
            want = max(min(room, states), floor * block)
            return want - block < held <= want + 4096 * (held // block)  # each block page-rounded

        assert fills(share, _part(rows[1, "cpu", "none"], "rollback copies"), 2), (host_gib, ranks)
        room = share - 4 * partition  # the accumulators stay resident beside the window
        assert fills(room, _part(rows[2, "nvme", "none"], WINDOW_PART), 4), (host_gib, ranks)
        on_nvme = _part(rows[3, "nvme", "none"], GRADS_ON_NVME_PART) > 0
        assert on_nvme == (4 * partition > share), (host_gib, ranks)


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_the_daemon_quota_holds_the_state_blocks_in_every_state_dtype(state_dtype):
    """With offload_optimizer cpu the state blocks are in the daemon session, whatever their dtype, beside its
    commit region and undo log, and with compressed ones the undo copy of the largest block ([Note: block
    undo]): host memory only with a daemon."""
    from offload.plan.fit import daemon_sizes
    from offload.plan.memory import COMMIT_PART, OFFLOAD_SUB_GROUP_CAP, UNDO_COPY_PART, UNDO_LOG_PART

    inp = EstimateInput(shapes=shapes_from_count(50_000_000), compute_bytes=4, state_dtype=state_dtype)
    row = estimate(inp).row(stage=2, optimizer="cpu")
    states = sum(n for what, where, n in row.parts if what.startswith("fp32 master + moments"))
    n = OFFLOAD_SUB_GROUP_CAP  # the largest block: a full sub-group, master 4 bytes an element and the moments
    copy = {"fp32": 0, "bf16": 8 * n, "int8": 6 * n + 8 * (n // 256)}[state_dtype]
    assert states > 0 and daemon_sizes(row, 1)[0] > states + copy
    with_daemon = estimate(dataclasses.replace(inp, daemon=True)).row(stage=2, optimizer="cpu")
    session = {what: n for what, _, n in with_daemon.parts if what in (COMMIT_PART, UNDO_LOG_PART, UNDO_COPY_PART)}
    assert with_daemon.host_bytes - row.host_bytes == sum(session.values()) > 0
    assert (UNDO_COPY_PART in session) == (state_dtype != "fp32") != (UNDO_LOG_PART in session)
    assert session.get(UNDO_COPY_PART, 0) >= copy


@pytest.mark.parametrize("key,dtype,nbytes", [("torch_dtype", "float16", 2), ("dtype", "bfloat16", 2),
                                              ("torch_dtype", "float32", 4), (None, None, 4)])
def test_hf_config_dtype_is_the_compute_dtype(tmp_path, capsys, key, dtype, nbytes):
    """Issue 41: --hf-config took fp32 whatever the config.json said. Its ``torch_dtype`` (``dtype`` in
    transformers 5) is the compute dtype now: the rows are those of --dtype with it, and the title names it;
    --dtype and a --config's bf16 / fp16 sections still decide where given."""
    pytest.importorskip("transformers")
    from tests.offload import hf_models as hf

    hf.llama_config().save_pretrained(tmp_path)
    fields = json.loads((tmp_path / "config.json").read_text())
    for k in ("dtype", "torch_dtype"):
        fields.pop(k, None)
    if key is not None:
        fields[key] = dtype
    (tmp_path / "config.json").write_text(json.dumps(fields))
    model = ["--hf-config", str(tmp_path), "--no-baseline", "--no-gpu", "--host-gib", "8", "--nvme-gib", "8"]
    flag = {2: "bf16", 4: "fp32"}[nbytes]
    assert _json_rows(capsys, *model) == _json_rows(capsys, *model, "--dtype", flag)
    assert main(["estimate", *model, "--stage", "3"]) == 0
    title = capsys.readouterr().out.splitlines()[0]
    assert f"{nbytes}-byte compute dtype" in title and (dtype is None or f"({dtype}, the config.json's)" in title)
    other = {2: "fp32", 4: "bf16"}[nbytes]
    assert _json_rows(capsys, *model, "--dtype", other) != _json_rows(capsys, *model)
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_batch_size": 1, "zero_optimization": {"stage": 3}}))  # fp32
    assert _json_rows(capsys, *model, "--config", str(config)) == _json_rows(capsys, *model, "--dtype", "fp32")


def test_a_30b_llama_fits_one_h200_node_with_the_accumulators_alone_on_nvme(capsys, tmp_path):
    """Issue 39: a Llama of 30.4B (LLaMA 30B's widths, 56 layers) on 141 GB of GPU, 128 GiB of host memory
    and 64 GiB of disk: bf16 master and int8 moments (114 GiB) stay in host memory and the bf16 gradient
    accumulators (57 GiB) go to NVMe ([Note: accumulators alone on NVMe] in offload.plan.tier_plan); with
    them in host memory too, no row fits."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 6656, "intermediate_size": 17920,
        "num_hidden_layers": 56, "num_attention_heads": 52, "num_key_value_heads": 52, "vocab_size": 32000,
        "max_position_embeddings": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}))
    node = ["estimate", "--hf-config", str(tmp_path), "--gpu-gib", str(141e9 / 2 ** 30), "--host-gib", "128",
            "--nvme-gib", "64", "--master-dtype", "bf16", "--state-dtype", "int8", "--grad-accum-dtype", "bf16",
            "--stage", "3"]
    assert main(node + ["--gradient-tier", "nvme"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("30,388,746,752 parameters")
    head, rows = _table(out)
    col = {name: i for i, name in enumerate(head)}
    fits = {tuple(r[:3]): r for r in rows if r[col["fits"]] == "yes"}
    assert list(fits) == [("3", "cpu", "none")]
    row = fits["3", "cpu", "none"]
    assert float(row[col["NVMe GiB"]]) == pytest.approx(56.6, abs=0.1)  # the accumulators, 2 B/param
    assert 114 < float(row[col["host GiB"]]) < 128 and float(row[col["device GiB"]]) < 141e9 / 2 ** 30
    assert "the least offloading that fits: stage 3, offload_optimizer cpu, offload_param none" in out
    assert main(node + ["--gradient-tier", "host"]) == 0
    assert "no row fits" in capsys.readouterr().out

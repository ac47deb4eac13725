"""The benchmark suites as a product: the runner's arguments, each suite's CLI, the shared helpers, and
benchmarks/RESULTS.md regenerated from the result files (CPU only, fast: no suite is run)."""

from __future__ import annotations

import importlib
import json
import sys
import types
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import __main__ as runner  # noqa: E402
from benchmarks import common as C  # noqa: E402
from benchmarks import report  # noqa: E402

OWN_SUITES = ("quantize", "gemm", "linear", "layer", "train")  # torchtitan's module is the lead's


def test_results_md_is_current():
    """RESULTS.md is what `python -m benchmarks report` makes of the result files (regenerate it if this fails)."""
    want = report.render()
    got = (REPO / "benchmarks" / "RESULTS.md").read_text()
    assert got == want, "benchmarks/RESULTS.md is stale: run `python -m benchmarks report`"


def test_results_md_covers_every_result_file():
    text = report.render()
    for gpu, suite, _ in report.result_files(C.RESULTS):
        assert f"## {suite} ({gpu})" in text


def test_unknown_suite_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as e:
        runner.main(["layer", "nosuch"])
    assert "unknown suite(s): nosuch" in str(e.value.code) and "quantize" in str(e.value.code)


def test_no_suite_is_an_error():
    with pytest.raises(SystemExit) as e:
        runner.main([])
    assert "--list" in str(e.value.code)


def test_list_names_every_suite(capsys):
    assert runner.main(["--list"]) == 0
    out = capsys.readouterr().out
    for s in runner.SUITES:
        assert out.count(f"{s} ") >= 1
    assert "report" in out


def test_plan_fits_or_says_how_to_split(capsys):
    assert runner.main(["--plan", "layer", "gemm"]) == 0
    assert "fits one device call" in capsys.readouterr().out
    assert runner.main(["--plan", "linear", "torchtitan", "layer"]) == 3
    out = capsys.readouterr().out
    assert "split it" in out and out.count("bash benchmarks/run_device.sh") >= 2
    fits, msg = runner.plan(list(runner.SUITES), quick=True, budget=runner.DEVICE_BUDGET_S)
    assert fits, msg  # every smoke run together fits one call
    calls = [line for line in runner.plan(list(runner.SUITES), False, 540)[1].splitlines() if "run_device" in line]
    assert calls and all(int(c.rsplit("~", 1)[1].split()[0]) <= 540 for c in calls)  # each call fits
    named = [w for c in calls for w in c.split("#")[0].split()[2:]]
    assert sorted(named) == sorted(runner.SUITES)  # every suite in exactly one call


def test_runner_calls_each_suite_main_with_out(monkeypatch, tmp_path):
    """Suite S is benchmarks.bench_S; its main gets --quick, --out DIR/S.json and the arguments after --."""
    calls = []
    fake = types.ModuleType("benchmarks.bench_fake")
    fake.main = lambda argv=None: calls.append(argv)
    broken = types.ModuleType("benchmarks.bench_broken")

    def fail(argv=None):
        raise RuntimeError("boom")

    broken.main = fail
    monkeypatch.setitem(sys.modules, "benchmarks.bench_fake", fake)
    monkeypatch.setitem(sys.modules, "benchmarks.bench_broken", broken)
    monkeypatch.setitem(runner.SUITES, "fake", ("a fake suite", 1, 1))
    monkeypatch.setitem(runner.SUITES, "broken", ("a failing suite", 1, 1))
    assert runner.main(["fake", "--quick", "--out-dir", str(tmp_path), "--", "--shapes", "dsv3-16b"]) == 0
    assert calls == [["--quick", "--out", f"{tmp_path}/fake.json", "--shapes", "dsv3-16b"]]
    assert runner.main(["broken", "fake", "--out-dir", str(tmp_path)]) == 1  # the failure reported, fake still ran
    assert calls[-1] == ["--out", f"{tmp_path}/fake.json"]


@pytest.mark.parametrize("suite", OWN_SUITES)
def test_suite_main_parses_quick_and_out(suite, tmp_path):
    mod = importlib.import_module(f"benchmarks.bench_{suite}")
    args = mod.build_parser().parse_args(["--quick", "--out", str(tmp_path / "x.json")])
    assert args.quick and args.out == str(tmp_path / "x.json")
    if torch.cuda.is_available():
        pytest.skip("main would run the suite on this GPU")
    with pytest.raises(SystemExit) as e:
        mod.main(["--quick", "--out", str(tmp_path / "x.json")])
    assert "CUDA" in str(e.value.code)
    assert not (tmp_path / "x.json").exists()


def test_torchtitan_suite_follows_the_convention():
    try:
        mod = importlib.import_module("benchmarks.bench_torchtitan")
    except ModuleNotFoundError as e:
        if e.name != "benchmarks.bench_torchtitan":
            raise
        pytest.skip("benchmarks/bench_torchtitan.py not in this tree yet")
    assert callable(mod.main)


@pytest.mark.parametrize("suite", ("gemm", "linear", "layer"))
def test_unknown_shape_is_a_clear_error(suite):
    mod = importlib.import_module(f"benchmarks.bench_{suite}")
    with pytest.raises(SystemExit) as e:
        mod.main(["--shapes", "dsv3-ep32,nosuch"])
    assert "nosuch" in str(e.value.code) and "dsv3-671b-ep8" in str(e.value.code)


def test_reference_shapes():
    """DESIGN §5, the two shapes of issue 40 included: dsv3-16b (64 experts top-6) and one rank of EP 8 of
    DeepSeek-V3 671B (32 local experts, 131072 routed rows: top-8 of 16384 tokens)."""
    s = C.SHAPES["dsv3-16b"]
    assert (s.experts, s.rows, s.hidden, s.ffn, s.top_k) == (64, 98304, 2048, 1408, 6)
    s = C.SHAPES["dsv3-671b-ep8"]
    assert (s.experts, s.rows, s.hidden, s.ffn, s.top_k) == (32, 131072, 7168, 2048, 8)
    assert C.SHAPES["dsv3-ep32"].top_k == 2 and C.SHAPES["mixtral-8x7b"].proj("up") == (28672, 4096)
    assert C.SHAPES["mixtral-8x7b"].proj("down") == (4096, 14336)
    with pytest.raises(ValueError):
        C.SHAPES["mixtral-8x7b"].proj("sideways")
    assert C.shape_list(None, quick=True) == list(C.QUICK_SHAPES) and C.shape_list(None, False) == list(C.SHAPES)


@pytest.mark.parametrize("name, slug", [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"),
                                        ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA GeForce RTX 4090", "rtx4090"),
                                        ("NVIDIA B200", "b200")])
def test_gpu_slug(name, slug):
    assert C.gpu_slug(name) == slug


@pytest.mark.parametrize("E, unit", [(8, 128), (128, 128), (64, 32), (32, 128)])
def test_token_counts(E, unit):
    gen = torch.Generator().manual_seed(0)
    for balance in ("balanced", "skewed"):
        counts = C.token_counts(131072, E, balance, gen, unit=unit)
        assert len(counts) == E and sum(counts) == 131072 and all(c % unit == 0 for c in counts)
        assert (balance == "skewed") == (min(counts) == 0)
    with pytest.raises(ValueError):
        C.token_counts(1024, 8, "uniform", gen)


def test_header_and_write_result(tmp_path):
    head = C.header("layer", True, tokens=16)
    for key in ("date", "gpu", "driver", "torch", "triton", "peers", "git", "quick"):
        assert key in head
    assert head["tokens"] == 16 and set(head["git"]) == {"commit", "dirty"}
    assert head["mxmoe_tree"] == "mxmoe"  # the repository's own package (an older tree would show its path)
    C.write_result(tmp_path / "sub" / "layer.json", head, [{"a": 1}])
    doc = json.loads((tmp_path / "sub" / "layer.json").read_text())
    assert doc["rows"] == [{"a": 1}] and doc["header"]["suite"] == "layer"


def test_render_layer_table_and_foreign_files(tmp_path):
    """A suite file's rows become its table (ratios computed from the rows); a file of another format is named
    as such instead of failing the report."""
    gpu = tmp_path / "h200"
    gpu.mkdir()
    head = {"gpu": "NVIDIA H200", "date": "2026-12-03", "torch": "2.11", "triton": "3.6", "git": {"commit": "abc"}}
    rows = [{"shape": "dsv3-16b", "recipe": "mxfp8_128", "balance": "balanced", "timing": "cudagraphs", "ms": 5.0,
             "bf16_ms": 6.5, "quant_share": 0.2, "peak_mem_gib": None, "saved_for_bwd_gib": None}]
    (gpu / "layer.json").write_text(json.dumps({"header": head, "rows": rows}))
    (gpu / "torchtitan.json").write_text(json.dumps({"header": ["old"], "runs": {}}))
    text = report.render(tmp_path)
    assert "| dsv3-16b | balanced | mxfp8_128 |  | 5.00 | 6.50 | 1.30x | 20% | – | – |" in text
    assert "not in the suite format" in text and "mxmoe commit abc" in text
    assert "![layer](results/h200/layer.png)" in text


def test_train_command_and_kept_convergence_rows():
    """The train suite wraps `mxmoe train --preset gpu-throughput` (8 micro-batches, the three recipes; --quick:
    two recipes, eager, a few steps) and keeps the convergence rows of the file it rewrites."""
    from benchmarks import bench_train as T

    full = T.train_command(T.build_parser().parse_args([]), "/tmp/run")
    assert full[1:5] == ["-m", "mxmoe", "train", "--preset"] and "gpu-throughput" in full
    opts = dict(zip(full[4::2], full[5::2]))
    assert opts["--recipes"] == "bf16,mxfp8,mxfp8_128" and opts["--grad-accum"] == "8" and opts["--steps"] == "40"
    assert opts["--compile"] == "auto" and opts["--out"] == "/tmp/run"
    quick = dict(zip(*[iter(T.train_command(T.build_parser().parse_args(["--quick"]), "/tmp/q")[4:])] * 2))
    assert quick["--recipes"] == "bf16,mxfp8_128" and quick["--compile"] == "none" and quick["--grad-accum"] == "1"
    rows, sources = T.carried_convergence(C.RESULTS / "h200" / "train.json")
    assert len(rows) == 9 and {r["recipe"] for r in rows} == {"bf16", "mxfp8", "mxfp8_128"} and sources


def test_render_torchtitan_rows(tmp_path):
    (tmp_path / "h200").mkdir()
    rows = [{"model": "deepseek_v3 debug", "method": "bf16", "tokens_per_s": 100000.0, "mfu": 0.1, "peak_gib": 5.0,
             "loss": [8.0, 6.5]},
            {"model": "deepseek_v3 debug", "method": "mxmoe mxfp8_128", "tokens_per_s": 110000.0, "mfu": 0.11,
             "peak_gib": 4.5, "peak_active_gib": 4.25, "backward_start_gib": 3.75, "loss": [8.0, 6.6],
             "expert_share": 0.4, "layer_ratio": 1.3, "ideal_speedup": 1.1}]
    (tmp_path / "h200" / "torchtitan.json").write_text(json.dumps({"header": {"gpu": "NVIDIA H200"}, "rows": rows}))
    text = report.render(tmp_path)
    assert ("| deepseek_v3 debug | mxmoe mxfp8_128 | 110,000 | 1.100x | – | 11.0% | 4.5 | 4.2 | 3.8 | 6.600 | – | 40% "
            "| 1.30x | 1.10x |") in text
    assert "| deepseek_v3 debug | bf16 | 100,000 | 1.000x | – | 10.0% | 5.0 | – | – | 6.500 |" in text  # older rows


FAKE_TRAINER = r'''
import os, subprocess, sys, time
if "--worker" not in sys.argv:  # as torchrun does: the worker in a session of its own
    sys.exit(subprocess.run([sys.executable] + sys.argv + ["--worker"], start_new_session=True).returncode)
a = sys.argv[1:]
opt = lambda k, d=None: a[a.index(k) + 1] if k in a else d
steps, seed, dump = int(opt("--training.steps")), int(opt("--debug.seed", 0)), opt("--job.dump_folder")
ckpt = os.path.join(dump, "ckpt.txt") if "--checkpoint.enable" in a else None
start = int(open(ckpt).read()) if ckpt and os.path.exists(ckpt) else 0
os.makedirs(dump, exist_ok=True)
print(f"MXMOE_BENCH_SYNC_STEPS={os.environ.get('MXMOE_BENCH_SYNC_STEPS')}", flush=True)
for st in range(start + 1, steps + 1):
    time.sleep(0.05)
    if st == 1 or st % 5 == 0 or st == start + 1:
        print(f"step: {st}  loss: {10 / st + 0.01 * seed:.5f}  memory: 1.50GiB(2%)  tps: 1,000  mfu: 1.00%", flush=True)
    if ckpt and st % int(opt("--checkpoint.interval")) == 0:
        open(ckpt, "w").write(str(st))
print("mxmoe-bench step memory: peak active 1.25 GiB, at backward start 1.10 GiB", flush=True)
'''


def _fake_torchtitan(monkeypatch, tmp_path):
    from benchmarks import bench_torchtitan as T

    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAINER)
    monkeypatch.setattr(T, "train_cmd", lambda *a, **k: [sys.executable, str(script)] + T.run_args(*a, **k))
    return T


def test_torchtitan_resume_check_kills_and_resumes(monkeypatch, tmp_path):
    """The kill-and-resume orchestration on a fake trainer (torchtitan's log lines, a checkpoint every
    interval): the killed run stops after the kill step, the rerun starts after the last checkpoint, and its
    losses are compared with the uninterrupted run's on the steps both log after it."""
    T = _fake_torchtitan(monkeypatch, tmp_path)
    a = T.build_parser().parse_args(["--resume-check", "--resume-steps", "40", "--resume-interval", "20",
                                     "--resume-kill", "30"])
    a.run_s = 120
    rows = T.resume_check(a, {}, [], tmp_path / "tt.json", tmp_path)
    (row,) = rows
    assert row["kind"] == "resume" and row["rc"]["uninterrupted"] == 0 and row["rc"]["resumed"] == 0
    killed = row["loss_by_step"]["killed"]
    assert 30 in killed and max(killed) < 40  # killed after step 30's line, before the end
    assert row["first_resumed_step"] == 21 and max(row["loss_by_step"]["resumed"]) == 40
    assert row["compared_steps"] == [25, 30, 35, 40] and row["max_abs_loss_diff_after_resume"] == 0
    assert row["rerun_steps"] == [25, 30] and row["max_abs_loss_diff_resumed_vs_killed"] == 0
    assert row["noise_steps"] == [1, 5, 10, 15, 20] and row["run_to_run_noise"] == 0
    assert json.loads((tmp_path / "tt.json").read_text())["rows"][0]["kind"] == "resume"
    # the kill reached the worker (in its own session, as torchrun starts it): its log ends before the last step
    log = (tmp_path / "resume_dsv3-debug_mxfp8_128_killed.txt").read_text()
    assert max(T.parse_log(log, 0)["steps"]) < 40


def test_torchtitan_parity_runs_two_seeds_and_summarizes(monkeypatch, tmp_path):
    """Parity on a fake trainer: methods x seeds 0 and 1, two at a time; the summary's bf16 seed spread and
    each method's gap to bf16 (mean over seeds of the last logged losses)."""
    T = _fake_torchtitan(monkeypatch, tmp_path)
    a = T.build_parser().parse_args(["--parity", "--parity-methods", "bf16,mxfp8_128", "--parity-tail", "2"])
    a.steps, a.run_s = 20, 120
    head = {}
    rows = T.parity(a, head, [], tmp_path / "tt.json", tmp_path)
    assert sorted((r["method"], r["seed"]) for r in rows) == [("bf16", 0), ("bf16", 1), ("mxfp8_128", 0),
                                                              ("mxfp8_128", 1)]
    assert all(r["peak_gib"] == 1.5 and r["peak_active_gib"] == 1.25 and r["backward_start_gib"] == 1.1
               for r in rows)  # the trainer's exit line
    s = head["parity"]
    assert s["bf16_seed_spread"] == pytest.approx(0.01) and s["gap_mxfp8_128"] == pytest.approx(0.0)
    assert s["within_mxfp8_128"] and s["final_loss"]["bf16"][1] == pytest.approx((10 / 15 + 10 / 20) / 2 + 0.01, abs=1e-4)


def test_torchtitan_launch_counts_rows_stand_beside_the_speed_rows(monkeypatch, tmp_path):
    """--launch-counts on a fake trainer: 30-step runs with step 25 profiled, rows of kind launch_counts that
    replace no speed row, logs of their own; the report lists their GEMM and quantization launches, not as speed."""
    T = _fake_torchtitan(monkeypatch, tmp_path)
    monkeypatch.setattr(T.C, "require_cuda", lambda suite: None)
    monkeypatch.setattr(T, "ensure_assets", lambda: None)
    seen = []
    monkeypatch.setattr(T, "read_profile", lambda dump: seen.append(dump) or {
        "experts_kernels": {"mx_quantize_cols_kernel": [9 + len(seen), 1.0],
                            "sm90_mxfp8_grouped_gemm_kernel": [14, 3.0], "gather_rows_kernel": [6, 0.5]}})
    fake, calls = T.train_cmd, []
    monkeypatch.setattr(T, "train_cmd", lambda *a, **k: calls.append(a) or fake(*a, **k))
    out = tmp_path / "h200" / "torchtitan.json"
    speed = {"model": "dsv3-16b", "method": "mxfp8_128", "tokens_per_s": 7.0, "commit": "aaa", "date": "d0"}
    C.write_result(out, {"suite": "torchtitan", "date": "2026-01-01", "gpu": "NVIDIA H200"}, [speed])
    T.main(["--launch-counts", "--models", "dsv3-16b", "--methods", "mxfp8_128+keep,mxfp8_128", "--run-s", "60",
            "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert rows[0] == speed and len(rows) == 3 and len(seen) == 2
    counts = {r["method"]: r for r in rows if r.get("kind") == "launch_counts"}
    assert set(counts) == {"mxfp8_128+keep", "mxfp8_128"} and all(max(r["steps"]) == 30 for r in counts.values())
    assert all(c[2] == 30 and tuple(c[6]) == tuple(T.profile_flags(25)) for c in calls)
    assert all(r["rc"] == 0 for r in counts.values())
    log = tmp_path / "h200" / "torchtitan_logs" / "launch_counts_dsv3-16b_mxfp8_128_keep.txt"
    assert "MXMOE_BENCH_SYNC_STEPS=1\n" in log.read_text()  # the trainer waits for the GPU at each step's end
    text = report.torchtitan_section(rows)
    assert "| dsv3-16b | mxfp8_128+keep | " in " ".join(text) and "gather_rows" not in " ".join(text)
    assert sum("| dsv3-16b | mxfp8_128 |" in line for line in text) == 2  # the speed row and its launch counts


def test_render_torchtitan_parity_and_resume_rows(tmp_path):
    """Parity and kill-and-resume rows get their own lines, not rows of the speed table."""
    (tmp_path / "h200").mkdir()
    rows = [{"model": "m", "method": "bf16", "tokens_per_s": 100.0, "loss": [3.0]},
            {"model": "m", "method": "bf16", "kind": "parity", "seed": 1, "steps": [995, 1000], "batch": 1,
             "loss": [2.0, 3.0], "commit": "abc"},
            {"model": "d", "method": "mxfp8_128", "kind": "resume", "interval": 100, "killed_after_step": 150,
             "first_resumed_step": 101, "compared_steps": [105, 110], "max_abs_loss_diff_after_resume": 0.0012}]
    (tmp_path / "h200" / "torchtitan.json").write_text(json.dumps({"header": {"gpu": "NVIDIA H200"}, "rows": rows}))
    text = report.render(tmp_path)
    assert "| m | bf16 | 1 | 1000 | 1 | 2.5000 | abc |" in text
    assert "first logged step 101" in text and "0.0012" in text
    assert text.count("| m | bf16 |") == 2  # the speed row and the parity row, nothing for the resume row


def test_render_torchtitan_parity_summary_resume_metrics_and_profiles(tmp_path):
    """The parity summary (bf16's seed spread, each method's gap), the resume row's three differences, and a
    table per model of the profiled step's kernel ms by class."""
    (tmp_path / "h200").mkdir()
    prof = lambda opt: {"trace": "iteration_100", "kernel_ms": {"experts_gemm": 20.0, "optimizer": opt},  # noqa: E731
                        "share": {"experts_gemm": 20 / (20 + opt), "optimizer": opt / (20 + opt)},
                        "kernel_total_ms": 20.0 + opt, "step_ms": 100.0}
    rows = [{"model": "m", "method": "bf16", "tokens_per_s": 100.0, "loss": [3.0], "profile": prof(60.0), "commit": "c1"},
            {"model": "m", "method": "mxfp8_128", "tokens_per_s": 110.0, "loss": [3.0], "profile": prof(80.0)}]
    rows += [{"model": "m", "method": me, "kind": "parity", "seed": sd, "steps": [1000], "loss": [v + 0.02 * sd]}
             for me, v in (("bf16", 3.0), ("mxfp8_128", 3.005)) for sd in (0, 1)]
    rows.append({"model": "d", "method": "mxfp8_128", "kind": "resume", "interval": 100, "killed_after_step": 150,
                 "first_resumed_step": 105, "compared_steps": [105, 200], "max_abs_loss_diff_after_resume": 0.125,
                 "rerun_steps": [105, 150], "max_abs_loss_diff_resumed_vs_killed": 6e-5, "noise_steps": [1, 100],
                 "run_to_run_noise": 0.04})
    lost = [{"commit": "c9", "date": "2026-12-04", "models": ["m"], "note": "its file was overwritten"}]
    (tmp_path / "h200" / "torchtitan.json").write_text(json.dumps({"header": {"gpu": "NVIDIA H200", "lost_runs": lost},
                                                                   "rows": rows}))
    text = report.render(tmp_path)
    assert "Lost run (c9, 2026-12-04; m): its file was overwritten." in text
    assert "| method | experts_gemm | optimizer | kernel total | step span | commit |" in text
    assert "| bf16 | 20.0 (25%) | 60.0 (75%) | 80.0 | 100.0 | c1 |" in text
    assert "bf16's seed spread (max - min final loss over seeds) 0.0200" in text and "mxfp8_128 +0.0050 (within" in text
    assert "re-run steps 105-150 0.00006" in text and "steps 1-100 0.0400" in text and "steps 105-200 0.1250" in text
    report.plot_torchtitan(rows, tmp_path / "h200" / "torchtitan.png")
    assert (tmp_path / "h200" / "torchtitan_parity.png").exists()


def test_torchtitan_profile_summary_classes_kernels(tmp_path):
    """A torch.profiler chrome trace -> GPU kernel ms by class (grouped GEMMs of torch and of mxmoe, the experts'
    other kernels, attention, dense GEMMs, optimizer, the rest), shares summing to 1, the step's span; the trace
    is read from torchtitan's profile folder and then deleted."""
    from benchmarks import bench_torchtitan as T

    k = lambda name, dur: {"ph": "X", "cat": "kernel", "name": name, "dur": dur}  # noqa: E731
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#100", "dur": 250_000},
        k("void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::"
          "GemmUniversal<cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int> >", 40_000),
        k("sm90_mxfp8_grouped_gemm_kernel", 20_000),
        k("mx_quantize_cols_kernel", 5_000), k("triton_poi_fused__grouped_mm__to_copy_transpose_1", 3_000),
        k("void at::native::vectorized_gather_kernel<16, long>(char*, char*, long*)", 2_000),
        k("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4> >", 30_000),
        k("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_3", 10_000),
        k("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 50_000),
        k("void multi_tensor_apply_kernel<TensorListMetadata<4>, FusedAdamMathFunctor<float, 4> >", 15_000),
        k("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", 7_000),
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "dur": 1_000},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 99_000},
    ]
    s = T.profile_summary({"traceEvents": events})
    assert s["kernel_ms"] == {"attention": 40.0, "dense_gemm": 50.0, "experts_gemm": 60.0, "experts_other": 10.0,
                              "optimizer": 15.0, "other": 8.0}
    assert s["kernel_total_ms"] == 183.0 and s["step_ms"] == 250.0
    assert sum(s["share"].values()) == pytest.approx(1.0, abs=1e-3)
    assert list(s["top_other"]) == ["triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "Memcpy DtoD (Device -> Device)"]
    assert s["experts_kernels"]["mx_quantize_cols_kernel"] == [1, 5.0] and len(s["experts_kernels"]) == 5
    assert T.profile_flags(100)[:3] == ["--profiling.enable_profiling", "--profiling.profile_freq", "100"]
    d = tmp_path / "dump" / "profile_traces" / "iteration_100"
    d.mkdir(parents=True)
    (d / "rank0_trace.json").write_text(json.dumps({"traceEvents": events}))
    r = T.read_profile(tmp_path / "dump")
    assert r["trace"] == "iteration_100" and r["kernel_total_ms"] == 183.0
    assert not (tmp_path / "dump" / "profile_traces").exists() and T.read_profile(tmp_path / "dump") is None


def test_torchtitan_resume_row_separates_resume_from_run_to_run_noise():
    """resume_row: the resumed run against the killed one on the steps it re-ran (interval, kill], against the
    uninterrupted one after the checkpoint, and the killed run against the uninterrupted one before any
    checkpoint (the noise without a resume)."""
    from benchmarks import bench_torchtitan as T

    full = {1: 10.0, 50: 5.0, 100: 4.0, 105: 3.9, 150: 3.5, 200: 3.0}
    killed = {1: 10.0, 50: 5.02, 100: 4.01, 105: 3.95, 150: 3.52}
    resumed = {105: 3.95, 150: 3.5201, 200: 3.1}
    rcs = {"uninterrupted": 0, "killed": -9, "resumed": 0}
    row = T.resume_row({"uninterrupted": full, "killed": killed, "resumed": resumed}, rcs, 100, 150)
    assert row["kind"] == "resume" and row["rc"] == rcs and row["first_resumed_step"] == 105
    assert row["rerun_steps"] == [105, 150] and row["max_abs_loss_diff_resumed_vs_killed"] == pytest.approx(1e-4)
    assert row["compared_steps"] == [105, 150, 200] and row["max_abs_loss_diff_after_resume"] == pytest.approx(0.1)
    assert row["noise_steps"] == [1, 50, 100] and row["run_to_run_noise"] == pytest.approx(0.02)
    empty = T.resume_row({"uninterrupted": full, "killed": killed}, rcs, 100, 150)
    assert empty["first_resumed_step"] is None and empty["max_abs_loss_diff_resumed_vs_killed"] is None


def test_torchtitan_merge_folds_device_files(tmp_path):
    """--merge: incoming rows stamped with their file's commit and date, put in place of the canonical rows of
    their key (those kept, without curves, in replaced_rows), the file's command line and a run line appended,
    rows of other keys kept, the parity summary recomputed, the logs beside the file copied."""
    from benchmarks import bench_torchtitan as T

    canon = tmp_path / "h200" / "torchtitan.json"
    old = [{"model": "m", "method": "bf16", "tokens_per_s": 1.0, "loss": [3.0], "commit": "aaa", "date": "d0"},
           {"model": "q", "method": "bf16", "tokens_per_s": 2.0, "loss": [3.0], "commit": "aaa", "date": "d0"}]
    C.write_result(canon, {"suite": "torchtitan", "date": "2026-01-01", "git": {"commit": "aaa"},
                           "argv": [["x"]], "runs": [{"date": "2026-01-01"}], "not_run": "z", "gpu": "NVIDIA H200"},
                   old)
    dev = tmp_path / "dev"
    (dev / "torchtitan_logs").mkdir(parents=True)
    (dev / "torchtitan_logs" / "m_bf16.txt").write_text("log")
    par = [{"model": "m", "method": me, "kind": "parity", "seed": sd, "loss": [v + sd * 0.01]}
           for me, v in (("bf16", 3.0), ("mxfp8_128", 3.002)) for sd in (0, 1)]
    inc = {"suite": "torchtitan", "date": "2026-02-02", "git": {"commit": "bbb", "dirty": None}, "argv": ["--y"],
           "gpu": "NVIDIA H200", "steps": 110, "parity": {"model": "m", "tail_logged_steps": 20}}
    C.write_result(dev / "torchtitan.json", inc,
                   [{"model": "m", "method": "bf16", "tokens_per_s": 5.0, "loss": [2.0]},
                    {"model": "m", "method": "mxfp8_128", "tokens_per_s": 6.0, "loss": [2.0], "commit": "ccc"}]
                   + par)
    T.main(["--merge", str(dev / "torchtitan.json"), "--out", str(canon)])
    d = json.loads(canon.read_text())
    h, rows = d["header"], {T.row_key(r): r for r in d["rows"]}
    assert len(rows) == 7 and rows[("q", "bf16", "speed", 0)]["commit"] == "aaa"
    assert rows[("m", "bf16", "speed", 0)]["tokens_per_s"] == 5.0
    assert (rows[("m", "bf16", "speed", 0)]["commit"], rows[("m", "bf16", "speed", 0)]["date"]) == ("bbb", "2026-02-02")
    assert rows[("m", "mxfp8_128", "speed", 0)]["commit"] == "ccc"  # a row's own commit stays
    assert h["replaced_rows"] == [{"model": "m", "method": "bf16", "tokens_per_s": 1.0, "commit": "aaa", "date": "d0"}]
    assert h["argv"] == [["x"], ["--y"]] and len(h["runs"]) == 2 and h["runs"][1]["commit"] == "bbb"
    assert h["runs"][1]["source"] == "torchtitan.json" and h["date"] == "2026-02-02" and h["git"]["commit"] == "bbb"
    assert h["not_run"] == "z" and "bbb (2026-02-02)" in h["git"]["note"] and "aaa (d0)" in h["git"]["note"]
    assert h["parity"]["bf16_seed_spread"] == pytest.approx(0.01) and h["parity"]["within_mxfp8_128"]
    assert (canon.parent / "torchtitan_logs" / "m_bf16.txt").read_text() == "log"


def test_torchtitan_rows_carry_their_call_commit(monkeypatch, tmp_path):
    """A row the bench writes carries the commit and date of its call's header; a row's own stay."""
    from benchmarks import bench_torchtitan as T

    head = {"git": {"commit": "abc"}, "date": "2026-03-03"}
    assert T.stamp({"model": "m"}, head) == {"model": "m", "commit": "abc", "date": "2026-03-03"}
    assert T.stamp({"commit": "x", "date": "y"}, head) == {"commit": "x", "date": "y"}

#!/usr/bin/env python
"""Mutation check: does the test suite catch each of a list of deliberate one-line breaks?

Not part of the default suite (it runs the targeted tests once per break, minutes in all).
For every entry of :data:`BREAKS` it copies the repository (working tree, or a git revision
with ``--rev``) into a temporary directory, replaces the entry's exact ``original`` snippet
in ``src/aligndp/<file>`` by ``replacement``, runs ``pytest -x`` on the entry's ``tests``
with ``PYTHONPATH=<copy>/src`` (so the copy, not the installed package, is imported by the
test process, spawned ranks and ``aligndp`` subprocesses alike) and reports:

- ``caught``: the tests failed (exit status 1), as they should;
- ``SURVIVED``: the tests passed with the break in place — the suite does not guard it;
- ``caught*``: the tests errored out in another way (status 2-5: collection/import error,
  or the timeout), which counts as caught but says little;
- ``SNIPPET NOT FOUND`` / ``SNIPPET AMBIGUOUS``: the original text is not in the file exactly
  once — the code moved; refresh the entry (an error: the exit status is non-zero);
- ``UNJUDGED``: the break's tests already fail without any break (the baseline run, skipped
  with ``--no-baseline``), so failing with it proves nothing (an error too).

Usage::

    python tools/mutate.py                      # every break, against the working tree
    python tools/mutate.py --files layout.py,mx/format.py --jobs 2
    python tools/mutate.py --only no_sync_keeps_syncing --rev HEAD
    python tools/mutate.py --check-snippets     # only verify that every snippet is found

Exit status 0 only if every selected break was caught and every snippet found.
Edit :data:`BREAKS` (one row per break) when code moves; keep every row one line of change.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "src/aligndp"


@dataclasses.dataclass(frozen=True)
class Break:
    name: str
    file: str
    """Path under src/aligndp/."""
    original: str
    """Exact text that must occur once in the file."""
    replacement: str
    tests: tuple[str, ...]
    """pytest arguments (files or node ids) expected to fail with the break in place."""
    area: str = ""


def B(
    name: str, file: str, original: str, replacement: str, tests: str | tuple[str, ...], area: str
) -> Break:
    return Break(
        name,
        file,
        original,
        replacement,
        (tests,) if isinstance(tests, str) else tuple(tests),
        area,
    )


DDP_T = "tests/test_ddp.py"
HAB_T = "tests/test_torch_habits.py"
# One row per break: (name, file under src/aligndp, original snippet, replacement, tests, area).
# Files being rewritten (ddp.py, grad_sync.py, optim/*, parallelize.py, param_gather.py, checkpoint.py, train*.py)
# need their snippets refreshed whenever that code changes: --check-snippets lists the stale ones.
BREAKS: list[Break] = [
    # ---- layout planner (layout.py, assign.py) ----
    B(
        "layout_registration_order",
        "plan/layout.py",
        "order = list(reversed(range(len(specs))))",
        "order = list(range(len(specs)))",
        "tests/test_layout.py",
        "layout planner",
    ),
    B(
        "layout_start_not_aligned",
        "plan/layout.py",
        "cursor = _round_up(cursor, align)",
        "cursor = cursor + 0",
        "tests/test_layout.py",
        "layout planner",
    ),
    B(
        "layout_buckets_never_reset",
        "plan/layout.py",
        "            filled = 0\n    if not buckets[-1]:",
        "            filled = filled\n    if not buckets[-1]:",
        "tests/test_layout.py",
        "layout planner",
    ),
    B(
        "layout_sharded_bucket_not_dp_divisible",
        "plan/layout.py",
        "multiple = dp_size * shard_align if mode is Mode.SHARDED else align",
        "multiple = align",
        "tests/test_layout.py",
        "layout planner",
    ),
    B(
        "validate_skips_alignment",
        "plan/layout.py",
        "            if p.start % align:",
        "            if False:",
        "tests/test_layout.py",
        "layout validate",
    ),
    B(
        "validate_skips_shard_divisibility",
        "plan/layout.py",
        "            if b.numel % (layout.dp_size * layout.shard_alignment):",
        "            if False:",
        "tests/test_layout.py",
        "layout validate",
    ),
    B(
        "validate_skips_owner_check",
        "plan/layout.py",
        "            if p.owner != shard:",
        "            if False:",
        "tests/test_layout.py",
        "layout validate",
    ),
    B(
        "assign_cost_is_numel",
        "plan/assign.py",
        "return float(max(m, n) * min(m, n) ** 2)",
        "return float(m * n)",
        "tests/test_layout.py",
        "layer-wise ownership",
    ),
    B(
        "assign_most_loaded_rank",
        "plan/assign.py",
        "rank = min(fits, key=lambda r: (totals[r], used[r], r))",
        "rank = max(fits, key=lambda r: (totals[r], used[r], r))",
        "tests/test_layout.py",
        "layer-wise ownership",
    ),
    # ---- buffers ----
    B(
        "buffer_param_data_not_copied",
        "runtime/buffer.py",
        "pview.copy_(p.data)",
        "pview.zero_()",
        "tests/test_buffer.py",
        "buffers",
    ),
    B(
        "buffer_main_grad_detached_copy",
        "runtime/buffer.py",
        "p.main_grad = view  #",
        "p.main_grad = view.clone()  #",
        "tests/test_buffer.py",
        "buffers",
    ),
    # ---- collectives and DDP readiness ----
    B(
        "gradient_sum_not_mean",
        "runtime/collectives.py",
        "    bucket.div_(dist.get_world_size(group))",
        "    pass",
        "tests/test_fused_wgrad_ddp.py",
        "collectives",
    ),
    B(
        "reduce_scatter_into_rank0_shard",
        "runtime/collectives.py",
        "out = shard_of(bucket, rank=dist.get_rank(group), dp_size=dist.get_world_size(group))",
        "out = shard_of(bucket, rank=0, dp_size=dist.get_world_size(group))",
        "tests/test_zero1.py",
        "collectives",
    ),
    B(
        "bucket_collective_skipped",
        "runtime/grad_sync.py",
        "self._works[ref] = all_reduce_mean(grad, group=self.process_group)",
        "self._works[ref] = None if ref.bucket == 1 else all_reduce_mean(grad, group=self.process_group)",
        DDP_T + "::test_case_sgd_several_buckets_matches_one_process",
        "DDP collectives",
    ),
    B(
        "readiness_counts_once",
        "runtime/grad_sync.py",  # matters for a fused layer used twice (autograd fires once)
        "self._fired[param] += 1",
        "self._fired[param] = 1",
        "tests/test_fused_wgrad_ddp.py",
        "DDP readiness",
    ),
    B(
        "readiness_any_param_of_bucket",
        "runtime/grad_sync.py",
        "return all(0 < self._expected[p] <= self._fired[p] for p in self._bucket_params[ref])",
        "return any(0 < self._expected[p] <= self._fired[p] for p in self._bucket_params[ref])",
        DDP_T + "::test_case_grads_match_torch_ddp_overlap",
        "DDP readiness",
    ),
    B(
        "stale_view_not_zeroed",
        "runtime/grad_sync.py",
        "            self._slot[param].view.zero_()",
        "            pass",
        DDP_T + "::test_case_unused_param_after_zero_grad_reads_zero",
        "DDP lazy zeroing",
    ),
    B(
        "no_sync_keeps_syncing",
        "runtime/grad_sync.py",
        "        self._sync_enabled = False\n",
        "        self._sync_enabled = previous\n",
        DDP_T + "::test_case_no_sync_after_readiness_is_learned_launches_nothing",
        "no_sync",
    ),
    B(
        "check_finite_misses_negative_inf",
        "runtime/grad_sync.py",
        "(~torch.isfinite(self._slot[p].view)).sum()",
        "(torch.isnan(self._slot[p].view) | (self._slot[p].view == float('inf'))).sum()",
        DDP_T + "::test_case_check_finite_names_the_param_for_nan_and_both_infinities",
        "check_finite",
    ),
    B(
        "check_finite_nan_only",
        "runtime/grad_sync.py",
        "(~torch.isfinite(self._slot[p].view)).sum()",
        "torch.isnan(self._slot[p].view).sum()",
        DDP_T + "::test_case_check_finite_names_the_param_for_nan_and_both_infinities",
        "check_finite",
    ),
    B(
        "check_finite_message_unnamed",
        "runtime/grad_sync.py",
        'f"{self.param_names[p]!r}: {v} element(s)"',
        'f"a param: {v} element(s)"',
        DDP_T + "::test_case_check_finite_names_the_param_for_nan_and_both_infinities",
        "check_finite",
    ),
    B(
        "no_broadcast_at_wrap",
        "runtime/ddp.py",
        "            self._broadcast_from_rank0()",
        "            pass",
        DDP_T + "::test_case_wrap_broadcasts_rank0_params_and_buffers",
        "wrap-time broadcast",
    ),
    B(
        "broadcast_params_not_buffers",
        "runtime/ddp.py",
        "for t in list(self.module.parameters()) + list(self.module.buffers()):",
        "for t in list(self.module.parameters()):",
        DDP_T + "::test_case_wrap_broadcasts_rank0_params_and_buffers",
        "wrap-time broadcast",
    ),
    # ---- optimizers: ZeRO-1, layer-wise Muon, clipping, param gathers ----
    B(
        "zero1_owned_segment_short",
        "optim/sharded.py",
        "start, end = max(p.start, lo), min(p.end, hi)",
        "start, end = max(p.start, lo), min(p.end, hi - 1)",
        "tests/test_zero1.py",
        "ZeRO-1",
    ),
    B(
        "grad_norm_not_all_reduced",
        "optim/base.py",
        "        all_reduce_sum(total, group=group)",
        "        pass",
        DDP_T + "::test_case_clipping_on_some_steps_only_matches_one_process",
        "clipping",
    ),
    B(
        "clip_by_squared_norm",
        "optim/composite.py",
        "        total = self.grad_norm()\n        for part in self.parts:",
        "        total = self.grad_norm() ** 2\n        for part in self.parts:",
        DDP_T + "::test_case_clipping_on_some_steps_only_matches_one_process",
        "clipping",
    ),
    B(
        "layerwise_every_rank_steps_every_matrix",
        "optim/layerwise.py",
        "return [i for i, o in enumerate(self.owners) if o == self.model.rank]",
        "return list(range(len(self.owners)))",
        "tests/test_muon.py",
        "layer-wise Muon",
    ),
    B(
        "param_gather_skipped",
        "runtime/param_gather.py",
        "self._pending[key] = all_gather_shards(",
        "self._pending[key] = None and all_gather_shards(",
        "tests/test_zero1.py",
        "param gathers",
    ),
    # ---- checkpoints ----
    B(
        "checkpoint_state_piece_at_offset_0",
        "state/model_space.py",
        "value.detach().reshape(-1), offset=offset, numel=numel",
        "value.detach().reshape(-1), offset=0, numel=numel",
        "tests/test_checkpoint.py",
        "checkpoints",
    ),
    B(
        "checkpoint_drops_muon_momentum",
        "optim/layerwise.py",
        "return sd | torch_state_to_model_space(self.inner[0], self.names, extents)",
        "return sd",
        "tests/test_muon.py",
        "checkpoints",
    ),
    # ---- MX formats and fused wgrad ----
    B(
        "mx_scale_round_to_nearest",
        "lowp/mx_format.py",
        "exponent = ((amax.view(torch.int32) >> _F32_MANTISSA_BITS) & 0xFF) - _E8M0_BIAS",
        "exponent = (((amax.view(torch.int32) + (1 << 22)) >> _F32_MANTISSA_BITS) & 0xFF) - _E8M0_BIAS",
        "tests/test_mx_format.py",
        "MX format",
    ),
    B(
        "mx_scale_round_to_nearest_without_torchao",
        "lowp/mx_format.py",  # the same break, hand-worked test only
        "exponent = ((amax.view(torch.int32) >> _F32_MANTISSA_BITS) & 0xFF) - _E8M0_BIAS",
        "exponent = (((amax.view(torch.int32) + (1 << 22)) >> _F32_MANTISSA_BITS) & 0xFF) - _E8M0_BIAS",
        "tests/test_mx_format.py::test_scale_is_floor_of_log2_amax_hand_worked",
        "MX format",
    ),
    B(
        "mx_no_saturation",
        "lowp/mx_format.py",
        "data = scaled.clamp(-fmt.max, fmt.max).to(fmt.dtype)",
        "data = scaled.to(fmt.dtype)",
        "tests/test_mx_format.py",
        "MX format",
    ),
    B(
        "mx_inf_block_not_nan",
        "lowp/mx_format.py",
        "return torch.where(torch.isfinite(amax), biased,",
        "return torch.where(~torch.isnan(amax), biased,",
        "tests/test_mx_format.py",
        "MX format",
    ),
    B(
        "mx_e4m3_emax_off_by_one",
        "lowp/mx_format.py",
        "ElementFormat(torch.float8_e4m3fn, 8, 448.0)",
        "ElementFormat(torch.float8_e4m3fn, 7, 448.0)",
        "tests/test_mx_format.py",
        "MX format",
    ),
    B(
        "mx_dequantize_scales_misplaced",
        "lowp/mx_format.py",
        "scale.to(torch.float32).repeat_interleave(block_size, dim=dim)",
        "scale.to(torch.float32).repeat_interleave(block_size, dim=dim).flip(dim)",
        "tests/test_mx_format.py",
        "MX format",
    ),
    B(
        "mx_dgrad_weight_wrong_dim",
        "lowp/backends.py",
        "return (_mx(grad_out, -1) @ _mx(weight, 0)).to(grad_out.dtype)",
        "return (_mx(grad_out, -1) @ _mx(weight, -1)).to(grad_out.dtype)",
        "tests/test_mx_linear.py",
        "MX linear",
    ),
    B(
        "fused_wgrad_overwrites",
        "lowp/backends.py",
        "main_grad.add_(self.wgrad(grad_out, x))",
        "main_grad.copy_(self.wgrad(grad_out, x))",
        "tests/test_mx_linear.py",
        "fused wgrad",
    ),
    B(
        "fused_wgrad_misalignment_accepted",
        "lowp/backends.py",
        "    if address % (align * item):",
        "    if False:",
        "tests/test_mx_linear.py",
        "fused wgrad",
    ),
    B(
        "fused_weight_never_marked_ready",
        "lowp/linear.py",
        "            sink.mark_ready(weight)",
        "            pass",
        "tests/test_fused_wgrad_ddp.py",
        "fused wgrad",
    ),
    B(
        "mx_bias_grad_halved",
        "lowp/linear.py",
        "grad_b = dy.sum(0, dtype=torch.float32) if",
        "grad_b = 0.5 * dy.sum(0, dtype=torch.float32) if",
        "tests/test_mx_linear.py",
        "MX linear",
    ),
    B(
        "fused_modules_not_found",
        "plan/fused.py",
        "return [(n, m) for n, m in model.named_modules() if isinstance(m, FusedWgradModule)]",
        "return []",
        "tests/test_fused_wgrad_ddp.py",
        "fused wgrad",
    ),
    # ---- routing ----
    B(
        "routing_embedding_to_muon",
        "plan/routing.py",
        "    if any(isinstance(mod, nn.Embedding) for _, mod in owners):",
        "    if False:",
        "tests/test_routing.py",
        "routing",
    ),
    B(
        "routing_head_to_muon",
        "plan/routing.py",
        '    if any(mod_name.rsplit(".", 1)[-1] in HEAD_NAMES for mod_name, _ in owners):',
        "    if False:",
        "tests/test_routing.py",
        "routing",
    ),
    # ---- the layout picture ----
    B(
        "layout_png_one_colour_for_every_rank",
        "app/plot.py",
        "color = cmap(p.owner % cmap.N) if layerwise else",
        "color = cmap(0) if layerwise else",
        "tests/test_guards.py::test_layout_png_draws_each_rank_with_its_share_of_elements",
        "aligndp layout --png",
    ),
    # ---- the CLI's exit codes ----
    B(
        "train_exit_0_when_a_rank_crashes",
        "app/train.py",
        "        return 1\n    return 0",
        "        return 0\n    return 0",
        "tests/test_guards.py",
        "CLI exit codes",
    ),
    B(
        "user_error_exit_1",
        "app/cli.py",
        "        return 2",
        "        return 1",
        "tests/test_cli_layout.py",
        "CLI exit codes",
    ),
    # ---- the step model of issue 11 (grad_sync.py, ddp.py, optim/*): torch DDP habits ----
    B(
        "unused_params_stepped",
        "runtime/grad_sync.py",
        "used = [p for p, v in zip(self.params, values[:n]) if v]",
        "used = list(self.params)",
        HAB_T + "::test_case_param_unused_on_every_rank_is_not_stepped",
        "step states",
    ),
    B(
        "usage_not_agreed",
        "runtime/grad_sync.py",
        "            dist.all_reduce(local, group=self.process_group)\n",
        "            pass\n",
        HAB_T + "::test_case_param_usage_changing_between_steps_matches_torch_ddp",
        "step states",
    ),
    B(
        "reopen_forgets_dp_size",
        "runtime/grad_sync.py",
        "flat[lo:hi].mul_(self.dp_size)",
        "flat[lo:hi].mul_(1)",
        HAB_T + "::test_case_backward_after_step_without_zero_grad_adds_to_old_grads",
        "step states",
    ),
    B(
        "published_grad_is_a_copy",
        "runtime/grad_sync.py",
        "p.grad = slot.view if slot.view.dtype == p.dtype else slot.view.to(p.dtype)",
        "p.grad = slot.view.clone()",
        HAB_T + "::test_case_clip_grad_norm_on_model_parameters_matches_torch_ddp",
        "step states",
    ),
    B(
        "sharded_grad_not_published",
        "runtime/grad_sync.py",
        "                p.grad = slot.sharded_grad\n",
        "                p.grad = None\n",
        HAB_T + "::test_case_sharded_grads_refuse_torch_ops_and_opt_clip_grad_norm_matches",
        "step states",
    ),
    B(
        "main_grad_property_keeps_stale",
        "runtime/grad_sync.py",
        "        self._take(param)\n        if self.state is StepState.IDLE:",
        "        if self.state is StepState.IDLE:",
        HAB_T + "::test_case_main_grad_written_after_zero_grad_is_reduced",
        "lazy zeroing",
    ),
    B(
        "nonfinite_skip_steps_anyway",
        "optim/composite.py",
        "                self.skipped_steps += 1\n                return None\n",
        "                self.skipped_steps += 1\n",
        HAB_T + "::test_case_nonfinite_on_one_rank_skips_the_step_on_every_rank",
        "check_finite",
    ),
    B(
        "buffers_not_broadcast_in_forward",
        "runtime/ddp.py",
        "            self._broadcast_buffers()",
        "            pass",
        HAB_T + "::test_case_batchnorm_buffers_broadcast_like_torch_ddp",
        "buffers",
    ),
    B(
        "masters_not_refreshed",
        "optim/sharded.py",
        "                refresh_master(p.master, p.buffer.param_data[p.segment.start : p.segment.end])",
        "                pass",
        HAB_T + "::test_case_weights_loaded_after_wrapping_reach_the_bf16_masters",
        "ZeRO-1",
    ),
    B(
        "old_wrapper_not_replaced",
        "runtime/ddp.py",
        "                old._replaced = True\n",
        "                pass\n",
        HAB_T + "::test_case_wrapping_again_moves_the_gradients_to_the_new_wrapper",
        "wrap",
    ),
    B(
        "join_never_checks",
        "runtime/ddp.py",
        "        if training < self.model.dp_size:",
        "        if False:",
        HAB_T + "::test_case_join_uneven_inputs_raise_on_every_rank_within_seconds",
        "uneven inputs",
    ),
]


@dataclasses.dataclass
class Result:
    brk: Break
    status: str
    seconds: float = 0.0
    detail: str = ""


def make_copy(dest: pathlib.Path, rev: str | None) -> None:
    """The repository's files (no .git, build output or runs) at ``dest``."""
    if rev is None:
        ignore = shutil.ignore_patterns(
            ".git", "runs", "__pycache__", "*.egg-info", ".pytest_cache", ".hypothesis"
        )
        shutil.copytree(ROOT, dest, ignore=ignore, symlinks=True)
    else:
        dest.mkdir(parents=True)
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)


def locate(brk: Break, tree: pathlib.Path) -> str | None:
    """None if the snippet occurs exactly once, else the error status."""
    path = tree / PACKAGE / brk.file
    if not path.exists():
        return f"SNIPPET NOT FOUND (no file {PACKAGE}/{brk.file})"
    count = path.read_text().count(brk.original)
    if count == 0:
        return f"SNIPPET NOT FOUND in {PACKAGE}/{brk.file}"
    if count > 1:
        return f"SNIPPET AMBIGUOUS ({count} occurrences in {PACKAGE}/{brk.file})"
    return None


def run_tests(tests: tuple[str, ...], tree: pathlib.Path, timeout: float) -> tuple[int, str, float]:
    """``pytest -x`` on ``tests`` in ``tree``: (exit status, -1 on timeout; first failure line; seconds)."""
    env = dict(
        os.environ,
        PYTHONPATH=str(tree / "src") + os.pathsep + str(tree),
        PYTHONDONTWRITEBYTECODE="1",
    )
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    start = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout
        )
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired:
        rc, out = -1, f"timed out after {timeout:.0f} s"
    lines = [
        ln for ln in out.splitlines() if ln.startswith(("FAILED", "ERROR"))
    ] or out.strip().splitlines()[-1:]
    return rc, (lines[0] if lines else ""), time.monotonic() - start


def run_break(brk: Break, tree: pathlib.Path, timeout: float) -> Result:
    error = locate(brk, tree)
    if error:
        return Result(brk, error)
    path = tree / PACKAGE / brk.file
    original = path.read_text()
    path.write_text(original.replace(brk.original, brk.replacement))
    try:
        rc, detail, seconds = run_tests(brk.tests, tree, timeout)
    finally:
        path.write_text(original)
    if rc == 0:
        return Result(brk, "SURVIVED", seconds, detail)
    if rc == 1:
        return Result(brk, "caught", seconds, detail)
    return Result(brk, f"caught* (rc {rc})", seconds, detail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated break names")
    parser.add_argument(
        "--files",
        default="",
        help="comma-separated files under src/aligndp (e.g. layout.py,mx/format.py)",
    )
    parser.add_argument(
        "--rev", default=None, help="test this git revision instead of the working tree"
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="breaks run at once (one repository copy each)"
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds per break")
    parser.add_argument(
        "--check-snippets", action="store_true", help="only check that every snippet is found once"
    )
    parser.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip running each break's tests without any break first",
    )
    parser.add_argument(
        "--list", action="store_true", help="print the breaks and the tests meant to catch them"
    )
    args = parser.parse_args(argv)

    selected = BREAKS
    if args.only:
        names = set(args.only.split(","))
        unknown = names - {b.name for b in BREAKS}
        if unknown:
            parser.error(f"unknown break(s): {sorted(unknown)}")
        selected = [b for b in selected if b.name in names]
    if args.files:
        files = set(args.files.split(","))
        selected = [b for b in selected if b.file in files]
    if args.list:
        for b in selected:
            print(f"{b.name:45s} {b.area:22s} {b.file:20s} {' '.join(b.tests)}")
        return 0

    with tempfile.TemporaryDirectory(prefix="aligndp-mutate-") as tmp:
        trees = [pathlib.Path(tmp) / f"copy{i}" for i in range(max(1, args.jobs))]
        for tree in trees:
            make_copy(tree, args.rev)
        if args.check_snippets:
            results = [Result(b, locate(b, trees[0]) or "found") for b in selected]
        else:
            free = list(trees)
            results = []
            failing: dict[tuple[str, ...], str] = {}
            if (
                not args.no_baseline
            ):  # the tests must pass without a break, else a failure proves nothing
                targets = sorted({b.tests for b in selected})

                def baseline(tests: tuple[str, ...]) -> tuple[tuple[str, ...], int, str]:
                    tree = free.pop()
                    try:
                        rc, detail, _ = run_tests(tests, tree, args.timeout)
                        return tests, rc, detail
                    finally:
                        free.append(tree)

                with concurrent.futures.ThreadPoolExecutor(max_workers=len(trees)) as pool:
                    for tests, rc, detail in pool.map(baseline, targets):
                        if rc != 0:
                            failing[tests] = detail
                            print(
                                f"BASELINE FAILS (rc {rc}) {' '.join(tests)}: {detail}", flush=True
                            )
                print(
                    f"baseline: {len(targets) - len(failing)} of {len(targets)} test targets pass unbroken",
                    flush=True,
                )
                unjudged = [b for b in selected if b.tests in failing]
                results += [Result(b, "UNJUDGED", 0.0, failing[b.tests]) for b in unjudged]
                selected = [b for b in selected if b.tests not in failing]

            def job(b: Break) -> Result:
                tree = free.pop()
                try:
                    return run_break(b, tree, args.timeout)
                finally:
                    free.append(tree)

            with concurrent.futures.ThreadPoolExecutor(max_workers=len(trees)) as pool:
                for result in pool.map(job, selected):
                    results.append(result)
                    print(
                        f"{result.status:22s} {result.brk.name:45s} {result.seconds:6.1f} s  {result.detail}",
                        flush=True,
                    )

    print()
    bad = [r for r in results if r.status.startswith(("SURVIVED", "SNIPPET", "UNJUDGED"))]
    for r in results:
        if r.status.startswith("SNIPPET"):
            print(
                f"ERROR {r.brk.name}: {r.status}: the code moved; refresh its row in BREAKS "
                f"(original: {r.brk.original.strip()[:80]!r})"
            )
    survivors = [r.brk.name for r in results if r.status == "SURVIVED"]
    print(
        f"{len(results)} break(s): {sum(r.status.startswith('caught') for r in results)} caught, "
        f"{len(survivors)} survived{': ' + ', '.join(survivors) if survivors else ''}, "
        f"{sum(r.status.startswith('SNIPPET') for r in results)} snippet(s) not found, "
        f"{sum(r.status == 'UNJUDGED' for r in results)} unjudged (tests fail without the break)"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""The profile readers of `benchmarks/profiling.py` and `context_parallel.py --profile`'s family tables, on
kernel tables written by hand (GPU-free)."""

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import context_parallel  # noqa: E402
from profiling import family_table, family_totals, kernel_family  # noqa: E402

ONE_GPU = ("4\t30900.0\tnvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN\n"
           "4\t4900.0\tkernel_cutlass_kernel_cudnndeepseek_sparse_attentionindexer_forwardindexer_fwd_sm90\n"
           "1\t22800.0\tsparse_attention_fwd_hopper_kernel\n")
RANK = ("2\t15700.0\tnvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT\n"
        "3\t3090.0\tindexer_forward_kernel\n"
        "1\t11000.0\tsparse_attention_fwd_hopper_kernel\n"
        "5\t1650.0\tvoid at::native::indexFuncLargeIndex<c10::BFloat16, long, unsigned int>\n"
        "2\t3670.0\tncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)\n"
        "2\t3670.0\tnccl:coalesced\n")


def test_kernel_families():
    assert kernel_family("kernel_cutlass_indexer_topk_kernel_cudnndeepseek_sparse_attentionindexer_top_k") == "top-k"
    assert kernel_family("kernel_cutlass_kernel_cudnndeepseek_sparse_attentionindexer_backward_sm90") == "indexer loss"
    assert kernel_family("kernel_cutlass_kernel_cudnndeepseek_sparse_attentionsparse_attention_backward") == \
        "sparse attention"
    assert kernel_family("void at::native::vectorized_elementwise_kernel<8, FillFunctor>") == "elementwise"
    assert kernel_family("some_new_kernel") == "other"


def test_family_totals_skip_annotations_and_the_table_sets_ranks_against_the_share():
    rank = family_totals(RANK)
    assert rank["NCCL"] == 3.67 and "nccl:coalesced" not in rank  # the annotation repeats the kernel's time
    table = family_table(family_totals(ONE_GPU), [rank, rank])
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines()[2:]}
    assert rows["NCCL"].endswith("| +3.67 |")
    assert rows["indexer scores"] == "| indexer scores | 4.90 | 2.45 | 3.09 | 3.09 | +0.64 |"
    assert rows["sparse attention"].endswith("| -0.40 |")
    assert table.splitlines()[2].startswith("| NCCL")  # largest excess first


def test_context_parallel_prints_each_layout_against_cp1(tmp_path, capsys):
    (tmp_path / "S32768_tp1_cp1_rank0.tsv").write_text(ONE_GPU)
    (tmp_path / "S32768_tp1_cp1_rank0.txt").write_text("GPU timeline: one GPU\n")
    for rank in (0, 1):
        (tmp_path / f"S32768_tp1_cp2_rank{rank}.tsv").write_text(RANK)
    (tmp_path / "S32768_tp1_cp2_rank0.txt").write_text("GPU timeline: rank 0\n")
    context_parallel.print_profiles(tmp_path)
    out = capsys.readouterr().out
    assert "S32768_tp1_cp2: kernel ms per family against CP-1's share" in out
    assert "| index_add_ / index_copy_ | 0.00 | 0.00 | 1.65 | 1.65 | +1.65 |" in out
    assert "GPU timeline: rank 0" in out

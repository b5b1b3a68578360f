"""Named clusters (`PRESETS`) and `get_cluster`: the papers' testbeds and this machine, every
figure with the data sheet or paper it comes from beside it; where no source was found, the
comment says what was assumed. One set of constants per preset: no per-scenario factor."""

from __future__ import annotations

from pathlib import Path

from poise.core.cluster import GBIT, GIB, Cluster, Link, PeakFlops
from poise.core.errors import ConfigError


def _uniform(
    name: str,
    dpn: int,
    npd: int,
    domains: int,
    peaks: PeakFlops,
    efficiency: float,
    half_rows: float,
    mem: float,
    intra: Link,
    inter: Link,
    wan: Link | None = None,
    floor: float = 0.0,
) -> Cluster:
    return Cluster(
        name=name,
        devices_per_node=dpn,
        nodes_per_domain=npd,
        domains=domains,
        peak_flops=peaks,
        memory_bytes=mem,
        intra_node=intra,
        inter_node=inter,
        inter_domain=wan or inter,
        gemm_half_rows=half_rows,
        gemm_efficiency=efficiency,
        expert_call_floor_s=floor,
    )


TFLOPS = 1e12
GB = 1e9

# Dense peaks per dtype (TFLOP/s, no sparsity), each from the source named beside it. None: no
# tensor-core path, the fp32 rate applies (`PeakFlops`).
# V100-PCIe: NVIDIA V100 data sheet, PCIe column (FP32 14, Tensor 112). Volta's tensor cores
# take fp16 only: no tf32 or bf16 rate (the A100 whitepaper's comparison table lists none).
V100_PCIE = PeakFlops(fp32=14.0 * TFLOPS, fp16=112.0 * TFLOPS)
# V100-SXM2: NVIDIA A100 whitepaper, comparison table, V100 SXM2 column at 1530 MHz boost
# (FP32 15.7, FP16 tensor 125 with fp16 or fp32 accumulate).
V100_SXM2 = PeakFlops(fp32=15.7 * TFLOPS, fp16=125.0 * TFLOPS)
# RTX 3090: NVIDIA GA102 whitepaper v1, Appendix A (FP32 35.6; "Peak FP16 Tensor TFLOPS with
# FP32 Accumulate" 71, the rate mixed-precision training uses). bf16 is assumed at that fp16
# rate (the quotes we read name fp16 only). The tf32
# tensor rate was not found in our sources: assumed no faster than fp32 (None).
RTX3090 = PeakFlops(fp32=35.6 * TFLOPS, bf16=71.0 * TFLOPS, fp16=71.0 * TFLOPS)
# A100 SXM 80 GB: NVIDIA A100 data sheet (FP32 19.5, TF32 156, BF16 and FP16 312, dense). The
# A800 differs from the A100 only in NVLink (400 instead of 600 GB/s; Reuters, Nov 2022).
A100 = PeakFlops(fp32=19.5 * TFLOPS, tf32=156.0 * TFLOPS, bf16=312.0 * TFLOPS, fp16=312.0 * TFLOPS)
# H100 SXM: NVIDIA H100 data sheet and whitepaper (FP32 66.9, TF32 494.7, BF16 and FP16 989.4
# dense; the data sheet's 989 and 1979 are with sparsity), as tabulated on
# glennklockwood.com/garden/processors/h100.
H100_SXM = PeakFlops(
    fp32=66.9 * TFLOPS, tf32=494.7 * TFLOPS, bf16=989.4 * TFLOPS, fp16=989.4 * TFLOPS
)

# The fraction of the peak large GEMMs reach (one figure per GPU, applied to every dtype):
# V100, fp32: FasterMoE (He et al., PPoPP'22) §3.1 and §5.3: GEMMs at transformer sizes reach
# "more than 90% of its peak throughput"; its predictor uses 90%.
V100_EFF = 0.90
# A100 SXM, bf16: stas00/ml-engineering, compute/accelerator/README.md, maximum achievable matmul
# FLOPS table: 271.2 of 312 TFLOP/s (best shape 1024x10240x5120, torch 2.6.0+cu126).
A100_EFF = 271.2 / 312.0
# H100 SXM, bf16: measured, Poise's own grouped experts on one H100 80GB HBM3 (torch 2.11,
# `benchmarks/gpu_experts.py`, docs/benchmarks.md "Expert compute on an H100"): forward and
# backward add 543-596 TFLOP/s at 4,096 -> 8,192 rows a slot over five expert shapes (8 slots),
# median 565 of 989.4. The best dense matmul reaches 794.5 (stas00/ml-engineering's maximum
# achievable matmul FLOPS table, torch 2.7.0); grouped experts do not. Their floor is
# `H100_EXPERT_CALL_FLOOR_S` below.
H100_EFF = 565.0 / 989.4
# RTX 3090: no published fraction found. Assumed FasterMoE's 90% for V100 fp32 GEMMs, since
# Pro-Prophet trains in fp32 on FasterMoE's code (its own planner assumes 100%: Comp_tp =
# 35.7e12 in king0722/Pro-Prophet load-balancing/search_algorithm.py).
RTX3090_EFF = 0.90

# The small-GEMM curve (`gemm_half_rows`): no published figure was found for any of these GPUs.
# Assumed 256 rows (V100, RTX 3090, A800) and 512 (H100, whose higher peak needs bigger tiles to
# fill), the values this project has used throughout; `poise calibrate` fits it on this machine.
HALF_ROWS = 256.0
HALF_ROWS_H100 = 512.0

# The per-call floor of a device's expert forward + backward per layer
# (`Cluster.expert_call_floor_s`). H100 SXM, bf16, measured: docs/benchmarks.md, Expert compute
# on an H100, floor column (median of 6 shapes: 0.78, 0.84, 0.86, 0.94, 0.99, 1.00 ms a call,
# `poise.nn.Experts` flat below ~1,000-2,000 rows a slot while the GPU waits for the host
# issuing kernels). Every other preset keeps 0 (no floor): nothing was measured for it.
H100_EXPERT_CALL_FLOOR_S = 0.90e-3

# One rate per link type, the same everywhere: measured where a source measured that link type,
# else nominal. PCIe 3.0 x16: 11 GB/s per direction, the rate FasterMoE's artifact measured and
# its predictor uses (fastermoe-ae toposim/devices.py bw_pcie = 88e9/8; nominal 15.75 GB/s).
# InfiniBand EDR (100 Gb/s nominal): 62 Gb/s, measured by the same artifact's predictor
# (bw_net = 62e9/8). PCIe 4.0 x16, NVLink and InfiniBand NDR: nominal (no measurement found).
PCIE3_X16 = 88 * GBIT
PCIE4_X16 = 31.5 * 1e9
IB_EDR = 62 * GBIT
IB_NDR = 400 * GBIT

# Link latencies: none of the papers gives one. Assumed: 10 us per message over PCIe and
# Ethernet within a datacentre, 5 us over InfiniBand, 3 us over NVLink, and 20 ms between
# datacentres (see cross-dc-1000).
LAT_PCIE = 10e-6
LAT_IB = 5e-6
LAT_NVLINK = 3e-6


def _presets() -> dict[str, Cluster]:
    return {
        # Two local processes on this 2-core machine, measured: `poise calibrate`, idle
        # (docs/benchmarks.md, "Calibration (`poise calibrate`)"): the GEMM
        # forward+backward fit, 206.2 GFLOP/s with half rows 39.6 (fp32 expert FFN), taken as
        # the peak at efficiency 1.0 and one rate for every dtype, as a calibrated file is; the
        # all-to-all fit, 1.68 GB/s and 145 us, for the intra-node link (the inter-node level,
        # unused on one node, the same). Memory: 8 GiB per process, assumed.
        "cpu-2": _uniform(
            "cpu-2",
            2,
            1,
            1,
            PeakFlops.uniform(206.2e9),
            1.0,
            39.6,
            8 * GIB,
            Link(1.68 * GB, 145e-6),
            Link(1.68 * GB, 145e-6),
        ),
        # FasterMoE "johnny" (§5.1): 2 nodes x 8 V100-PCIe (32 GB, the larger of the data
        # sheet's two sizes: the paper does not say which). Intra-node PCIe 3.0 x16. One IB EDR
        # NIC per node, run at only 50 Gb/s for lack of a x16 slot (§5.1; also the default
        # FMOE_FASTER_GLBPLC_NETBW of fastmoe's shadow_policy.py), shared by the node's 8 GPUs.
        "v100-ib50": _uniform(
            "v100-ib50",
            8,
            2,
            1,
            V100_PCIE,
            V100_EFF,
            HALF_ROWS,
            32 * GIB,
            Link(PCIE3_X16, LAT_PCIE),
            Link(50 * GBIT, LAT_IB, shared_by=8),
        ),
        # FasterMoE "trevor" (§5.1): 16 nodes x 4 V100-SXM2 (memory assumed 32 GB as above) in an
        # NVLink ring, half the edges double links; one IB EDR NIC per node, shared by 4 GPUs.
        # The link model has one intra-node rate per device; derived from the artifact's
        # measured pair rates (toposim/devices.py create_nvlink_cluster: single link 171, double
        # 317, other pairs 88 Gb/s): in an all-to-all a GPU sends a third of its bytes to each
        # of its 3 peers at once and the slowest pair (88 Gb/s, 11 GB/s: the diagonal, no
        # NVLink) bounds it, so 3 x 11 = 33 GB/s per device.
        "v100-nvlink-ib100": _uniform(
            "v100-nvlink-ib100",
            4,
            16,
            1,
            V100_SXM2,
            V100_EFF,
            HALF_ROWS,
            32 * GIB,
            Link(3 * 88 * GBIT, LAT_NVLINK),
            Link(IB_EDR, LAT_IB, shared_by=4),
        ),
        # Pro-Prophet (arXiv 2411.10003 §VI Testbed) HPWNV/HPNV: nodes of 4 RTX 3090 24 GB on
        # PCIe 3.0 (each CPU attached to 2 GPUs), 100 Gb/s (EDR) InfiniBand; 4 nodes (also :8).
        # One NIC per node is assumed (the count is not stated). Table IV's HPNV nodes
        # also join GPU pairs by an NVLink bridge (GA102: 56.25 GB/s per direction); the link
        # model has one intra-node rate per device, so the pairs are not modelled: all
        # intra-node traffic is priced at the PCIe rate (2 of each GPU's 3 peers are on PCIe).
        "rtx3090-ib100": _uniform(
            "rtx3090-ib100",
            4,
            4,
            1,
            RTX3090,
            RTX3090_EFF,
            HALF_ROWS,
            24 * GIB,
            Link(PCIE3_X16, LAT_PCIE),
            Link(IB_EDR, LAT_IB, shared_by=4),
        ),
        # HybridEP (arXiv 2510.19470 §V-A): nodes of 8 A800 (80 GB assumed: the variant is not
        # stated), PCIe 3.0 x16 inside (the paper quotes 128 Gb/s, its nominal), 10 Gb/s Ethernet
        # between; one node stands in for one datacentre, so each node is a domain (the
        # low-bandwidth boundary HybridEP partitions on); 2 nodes (also :4). One Ethernet link
        # per node, shared by its 8 GPUs (§V-A: the DCs, one node each, are connected by 10 Gbps
        # Ethernet); 100 us per message between them: assumed.
        "a800-eth10": _uniform(
            "a800-eth10",
            8,
            1,
            2,
            A100,
            A100_EFF,
            HALF_ROWS,
            80 * GIB,
            Link(PCIE3_X16, LAT_PCIE),
            Link(PCIE3_X16, LAT_PCIE),
            Link(10 * GBIT, 100e-6, shared_by=8),
        ),
        # DGX H100: 8 H100 SXM 80 GB on NVLink 4 (900 GB/s bidirectional, 450 per direction: H100
        # data sheet); 8 ConnectX-7 NICs, one per GPU (NVIDIA DGX H100 User Guide §1.2.3, Table
        # 6), each InfiniBand NDR 400 Gb/s (4 lanes x 100 Gb/s).
        "dgx-h100": _uniform(
            "dgx-h100",
            8,
            8,
            1,
            H100_SXM,
            H100_EFF,
            HALF_ROWS_H100,
            80 * GIB,
            Link(450 * GB, LAT_NVLINK),
            Link(IB_NDR, LAT_IB),
            floor=H100_EXPERT_CALL_FLOOR_S,
        ),
        # HybridEP's large-scale setting (§V-G): 1,000 datacentres simulated with SimAI. The
        # GPUs, the wide-area bandwidths (only in Fig. 17) and latency are not in the paper's
        # text. Assumed: one DGX H100 node per datacentre (as above); 10 Gb/s per node between
        # datacentres, the inter-DC rate of HybridEP's own testbed (§V-A), shared by its 8 GPUs;
        # 20 ms per message (no source; the value this preset has always had).
        "cross-dc-1000": _uniform(
            "cross-dc-1000",
            8,
            1,
            1000,
            H100_SXM,
            H100_EFF,
            HALF_ROWS_H100,
            80 * GIB,
            Link(450 * GB, LAT_NVLINK),
            Link(IB_NDR, LAT_IB),
            Link(10 * GBIT, 20e-3, shared_by=8),
        ),
        # Parm's testbeds (INFOCOM 2024): their hardware table could not be read; the GPUs are
        # those of the same group's FSMoE testbeds (ASPLOS 2025, Table 3). One server of 8 RTX
        # A6000 (NVIDIA RTX A6000 data sheet: 154.8 TFLOP/s fp16 tensor, dense, the rate used
        # for every dtype: the layers are fp16) on PCIe 4.0 x16.
        "parm-8gpu": _uniform(
            "parm-8gpu",
            8,
            1,
            1,
            PeakFlops.uniform(154.8 * TFLOPS),
            RTX3090_EFF,
            HALF_ROWS,
            48 * GIB,
            Link(PCIE4_X16, LAT_PCIE),
            Link(PCIE4_X16, LAT_PCIE),
        ),
        # 8 nodes of 4 RTX 2080 Ti (Turing whitepaper: 53.8 TFLOP/s fp16 tensor with fp32
        # accumulate) on PCIe 3.0 x16, one IB EDR NIC per node (the count assumed, as above).
        "parm-32gpu": _uniform(
            "parm-32gpu",
            4,
            8,
            1,
            PeakFlops.uniform(53.8 * TFLOPS),
            RTX3090_EFF,
            HALF_ROWS,
            11 * GIB,
            Link(PCIE3_X16, LAT_PCIE),
            Link(IB_EDR, LAT_IB, shared_by=4),
        ),
    }


PRESETS: dict[str, Cluster] = _presets()


def get_cluster(spec: str) -> Cluster:
    """A preset name, `preset:N` (N nodes; N domains for multi-domain presets) or a YAML path."""
    name, _, count = spec.partition(":")
    if name in PRESETS:
        cluster = PRESETS[name]
        if not count:
            return cluster
        if not count.isdigit() or int(count) < 1:
            raise ConfigError(
                f"size after ':' must be a positive integer, got {count!r}",
                source=spec,
                field="cluster",
            )
        n = int(count)
        if cluster.domains > 1:
            return cluster.resized(domains=n, name=spec)
        return cluster.resized(nodes_per_domain=n, name=spec)
    path = Path(spec)
    if path.suffix in (".yaml", ".yml", ".json") or path.exists():
        return Cluster.load(path)
    raise ConfigError(
        f"unknown cluster preset (known: {', '.join(PRESETS)}) and no such file",
        source=spec,
        field="cluster",
    )

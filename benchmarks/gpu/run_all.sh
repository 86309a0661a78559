#!/usr/bin/env bash
# The CUDA backend's numbers for issue 6, on one NVIDIA GPU (H100 or H200), in one go:
# correctness first (the GPU tests), then every target's benchmark, into benchmarks/results/gpu/.
#
#   bash benchmarks/gpu/run_all.sh            # all suites
#   SUITES="decode nano-vllm" bash benchmarks/gpu/run_all.sh
#
# Dummy bf16 weights of the published shapes (tokenmill/presets.py), so nothing is
# downloaded. Each JSON holds the GPU name, driver, CUDA, torch and triton versions.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${RESULTS:-benchmarks/results/gpu}
mkdir -p "$OUT"
GPU=$(python -c "import torch; print(torch.cuda.get_device_name(0).split()[-1].lower())")
SUITES=${SUITES:-"tests decode throughput hf-batch nano-vllm attention"}
bench() { python -m tokenmill bench gpu "$@"; }

for suite in $SUITES; do
  case $suite in
    tests)
      python -m pytest -q -p no:cacheprovider tests/gpu tests/unit/test_triton_attention.py \
        tests/unit/test_cuda_graphs.py tests/engine/test_triton_engine_features.py \
        2>&1 | tee "$OUT/$GPU-tests.log" ;;
    decode)
      # Single stream, batch 1: >= 90% of (copy bandwidth / weight bytes); SGLang: 158 tok/s.
      bench --suite decode --model llama-3.1-8b --max-model-len 4096 \
        --result-file "$OUT/$GPU-llama-3.1-8b-decode-bf16.json"
      bench --suite decode --model llama-3.1-8b --max-model-len 4096 --quantization fp8 \
        --result-file "$OUT/$GPU-llama-3.1-8b-decode-fp8.json"
      bench --suite decode --model qwen3-0.6b --max-model-len 4096 \
        --result-file "$OUT/$GPU-qwen3-0.6b-decode-bf16.json" ;;
    throughput)
      # 1,000 requests x (1,000 in, 1,000 out): >= 10,000 out tok/s in bf16, > 15,220 in fp8.
      bench --suite throughput --model llama-3.1-8b --max-model-len 2048 \
        --result-file "$OUT/$GPU-llama-3.1-8b-throughput-bf16.json"
      bench --suite throughput --model llama-3.1-8b --max-model-len 2048 --quantization fp8 \
        --result-file "$OUT/$GPU-llama-3.1-8b-throughput-fp8.json" ;;
    hf-batch)
      # >= 5x transformers' continuous batching (generate_batch) on the same workload. Without
      # flash attention transformers made ~580 tok/s on an H200 (2026-11-26): 64 requests of
      # 512 in / 512 out on Qwen3-0.6B's shape take it about a minute.
      bench --suite hf-batch --model qwen3-0.6b --max-model-len 2048 --num-prompts 64 \
        --input-len 512 --output-len 512 \
        --result-file "$OUT/$GPU-qwen3-0.6b-vs-transformers.json" ;;
    nano-vllm)
      # nano-vllm's workload: 256 requests, lengths uniform in 100..1024, Qwen3-0.6B.
      bench --suite nano-vllm --model qwen3-0.6b --max-model-len 2048 \
        --result-file "$OUT/$GPU-qwen3-0.6b-nano-vllm.json" ;;
    attention)
      # The decode attention kernel alone against the copy bandwidth, launch settings swept;
      # the fastest become this GPU model's tuning file (commit it with the results).
      SLUG=$(python -c "import torch; from tokenmill.kernels.tuning.decode_attention import device_slug; print(device_slug(torch.cuda.get_device_name(0)))")
      python benchmarks/gpu/attention_bw.py --result-file "$OUT/$GPU-decode-attention-bw.json" \
        --write-tuning "tokenmill/kernels/tuning/attention/$SLUG.json" ;;
    *) echo "unknown suite $suite" >&2; exit 2 ;;
  esac
done

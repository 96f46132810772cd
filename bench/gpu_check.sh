#!/usr/bin/env bash
# GPU check (3-5 minutes on one GPU): on a CUDA machine with the project installed
# (pip install torch && pip install -e ".[dev]"), prints the engine and runtime step time against the
# best plain loop in bf16 and fp16 (real GradScaler), then runs the application on the GPUs present:
# one GPU in bf16 and fp16, and DDP on nccl over all of them when there are two or more.
#
#     bash bench/gpu_check.sh 2>&1 | tee gpu_check.txt
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

python - <<'EOF'
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s): "
      + ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))
EOF

# 1. Step time against the plain loop, bf16 and fp16 (~2-3 minutes).
python bench/gpu_check.py steps --steps 200 --rounds 5

# 2. The application end to end on one GPU: digits to >= 0.95, bf16 and fp16 (loss scaling).
summary() {  # the last evaluation of a run folder, one line
    python - "$1" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl")]
last = [r for r in rows if "eval/accuracy" in r][-1]
print(f"  step {last['step']}: eval/accuracy {last['eval/accuracy']:.4f}, eval/num_samples {last['eval/num_samples']}")
EOF
}
for precision in bf16 fp16; do
    python -m app hardware=gpu precision=$precision logging.progress_bar=false "hydra.run.dir=$out/gpu_$precision" >/dev/null
    echo "gpu_check app hardware=gpu precision=$precision:"; summary "$out/gpu_$precision"
done

# 3. DDP on nccl over every GPU (needs two or more).
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then
    python -m app hardware=multi_gpu hardware.num_processes="$gpus" precision=bf16 logging.progress_bar=false \
        "hydra.run.dir=$out/multi_gpu" >/dev/null
    echo "gpu_check app hardware=multi_gpu hardware.num_processes=$gpus (nccl):"; summary "$out/multi_gpu"
else
    echo "gpu_check: one GPU, so DDP on nccl was not run (hardware=multi_gpu needs two or more)."
fi

#!/usr/bin/env bash
# One prepared distillation run on a CUDA machine: many times the everyday-chat answers of the demo
# target that a CPU session can generate, and a draft fine-tuned on them (issue 12: a draft that
# agrees with the target on everyday chat). About 8-9 minutes; give the device call a 590 s limit.
#
#   bash bench/gpu_prepare.sh            # here, once: what the device call carries (see that file)
#   bash bench/gpu_distill.sh [OUTDIR]   # there
#
# `specdec-distill --device cuda` generates the target's answers (seed-3 task templates about both topic lists, self-instruct
# questions, second turns and resampled answers about the training topics; the held-out topics stay
# out), packs them into OUTDIR/chat-seed3.npz as soon as they exist (so they come back even if a later
# stage runs out of time), prefills the teacher features over them and every packed file of earlier
# runs, and fine-tunes the shipped draft for DISTILL_TRAIN_MIN minutes into OUTDIR/eagle-gpu. It does
# not evaluate: a CPU session compares the drafts on the usual held-out sets (`specdec-distill
# --eval-only`, `bench/draft_ab.py`) and can go on training on the new file there (`--data`).
# Every budget is total across resumes and the run resumes its work directory (/tmp/eagle-gpu.work):
# if the device call's limit cuts it, the same command on the still-warm machine goes on where it
# stopped (answers, features and training are cached there).
. "$(dirname "$0")/gpu_env.sh" "$@"

step env 60 bash -c 'nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c "import torch, transformers; print(torch.__version__, torch.version.cuda, transformers.__version__)"'
step distill "${DISTILL_S:-540}" python3 -m specdec_tools.distill --device cuda --arch eagle --target smollm2 \
  --out "$out/eagle-gpu" --work /tmp/eagle-gpu.work --init-draft specdec/drafts/smollm2-eagle --init-vocab \
  --feature-layers 2,14 --answers 0 --chat-answers 40000 --chat-topics all --chat-seed 3 --chat-minutes "${DISTILL_CHAT_MIN:-3}" \
  --questions-per-topic 12 --resample-minutes 1 --gen-batch 256 --gen-tokens 256 --text-tokens 200000 \
  --data distill_data/smollm2/chat-seed1.npz distill_data/smollm2/chat-seed2.npz \
  distill_data/smollm2/chat-seed3-more.npz specdec/drafts/smollm2-corpus/corpus.npz --pack-data "$out/chat-seed3.npz" \
  --feature-batch 64 --batch-tokens 16384 --lr 3e-4 --minutes "${DISTILL_TRAIN_MIN:-1}" --train-steps 4 \
  --save-minutes 0.5 --eval-prompts 0 --resume
ls -la "$out" "$out/eagle-gpu" 2>&1

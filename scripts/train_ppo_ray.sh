#!/usr/bin/env bash
# Submit `orlhf train-ppo` to a running Ray cluster through the Jobs API.
#
#   RAY_ADDRESS=http://HEAD_IP:8265 bash scripts/train_ppo_ray.sh [extra flags]
#
# The cluster needs orlhf installed on every node (bash scripts/install.sh there), and the paths below (/models,
# /data, /checkpoints) on storage every node sees: each rank saves its own shards, and a restart after a lost node
# reads them back on another (docs/multinode.md). With Ray's token authentication on, export RAY_AUTH_MODE=token
# and RAY_AUTH_TOKEN (or keep the token in ~/.ray/auth_token). Rendezvous addresses follow each host's route to the
# head; add --socket_ifname IFACE when the hosts share another network.
# The flags below are a 70B-style layout on 8 nodes x 8 GPUs (see `orlhf plan` with the same flags); without
# GPUs, drop them to run the built-in demo on the cluster's CPUs.
set -euo pipefail
: "${RAY_ADDRESS:=http://127.0.0.1:8265}"
exec ray job submit --address "$RAY_ADDRESS" --runtime-env-json '{"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}' \
  -- orlhf train-ppo \
  --actor_num_nodes 2 --actor_num_gpus_per_node 8 \
  --critic_num_nodes 2 --critic_num_gpus_per_node 8 \
  --ref_num_nodes 1 --ref_num_gpus_per_node 8 \
  --reward_num_nodes 1 --reward_num_gpus_per_node 8 \
  --vllm_num_engines 4 --vllm_tensor_parallel_size 4 \
  --pretrain /models/llama-70b-sft --reward_pretrain /models/llama-70b-rm --prompt_data /data/prompts.jsonl \
  --zero_stage 3 --bf16 --adam_offload --gradient_checkpointing --flash_attn \
  --micro_train_batch_size 4 --train_batch_size 128 --micro_rollout_batch_size 8 --rollout_batch_size 1024 \
  --max_epochs 1 --prompt_max_len 1024 --generate_max_len 1024 \
  --actor_learning_rate 5e-7 --critic_learning_rate 9e-6 --init_kl_coef 0.01 \
  --save_path /checkpoints/ppo --ckpt_path /checkpoints/ppo/ckpt --save_steps 20 \
  "$@"

#!/usr/bin/env bash
# GRPO in verl 0.9.1 with its rollouts recorded by floe (docs/verl.md). Two ways in:
#
#   MODE=manager  verl's one-step-off trainer, whose batch comes from
#                 floe_bridge.verl.FloeAgentLoopManager (agent_loop_manager_class)
#   MODE=legacy   the same manager in verl's legacy synchronous trainer (trainer.use_v1=false)
#   MODE=loop     verl's default V1 trainer, whose own manager runs floe_bridge.verl.FloeAgentLoop
#                 (agent_name floe_agent) per trajectory; V1 has no weight-sync hook (docs/verl.md)
#
# floe serve runs beside it (examples/verl/floe-serve.yaml), -upstream naming verl's vLLM
# servers; the control address below is floe's -control-addr.
set -euo pipefail
MODE=${MODE:-manager}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"   # harness.py
export FLOE_CONTROL_URL=${FLOE_CONTROL_URL:-http://127.0.0.1:8701}

common=(
  data.train_files="$DATA/train.parquet" data.val_files="$DATA/test.parquet"
  data.train_batch_size=32 data.return_raw_chat=True
  actor_rollout_ref.model.path="$MODEL"
  actor_rollout_ref.rollout.name=vllm
  actor_rollout_ref.rollout.n=8
  actor_rollout_ref.rollout.calculate_log_probs=True
  actor_rollout_ref.rollout.prompt_length=4096
  actor_rollout_ref.rollout.response_length=28672
  algorithm.adv_estimator=grpo
  # floe's settings (FloeSettings): the control API, the harness runner, the row layout.
  +floe.control_url="$FLOE_CONTROL_URL"
  +floe.runner=harness:run
  +floe.layout=session
  +floe.concurrency=64
  # Weight sync: floe pauses around verl's update_weights and resumes at the global step.
  +actor_rollout_ref.rollout.checkpoint_manager_class=floe_bridge.verl.FloeCheckpointEngineManager
  +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.floe.control_url="$FLOE_CONTROL_URL"
)

case $MODE in
manager)
  # One-step-off: batch k+1's sessions run while the actor trains on batch k.
  python3 -m verl.experimental.one_step_off_policy.main_ppo "${common[@]}" \
    +actor_rollout_ref.rollout.agent.agent_loop_manager_class=floe_bridge.verl.FloeAgentLoopManager "$@"
  ;;
legacy)
  python3 -m verl.trainer.main_ppo "${common[@]}" trainer.use_v1=false \
    +actor_rollout_ref.rollout.agent.agent_loop_manager_class=floe_bridge.verl.FloeAgentLoopManager "$@"
  ;;
loop)
  python3 -m verl.trainer.main_ppo "${common[@]}" \
    actor_rollout_ref.rollout.agent.agent_loop_config_path="$HERE/agent_loops.yaml" \
    actor_rollout_ref.rollout.agent.default_agent_loop=floe_agent "$@"
  ;;
esac

"""Prefix reuse must not change what greedy decoding produces: the shared-prefix backend's batched waves (the
evaluator's engine, benchmarks/rollout_bench.py) equal one episode at a time with plain ``generate``, and the
trainer's rollouts through ``tau2_rl.backends.trl_prefix`` equal TRL's own generation call. No timing here: the
benchmark measures speed.

Shrunk (each marked where set): 4 episodes, at most 3 turns of 8 tokens, and 16 turns in the slow variants (turn
caching: each episode keeps its KV between waves, so long horizons are the case to check); the real system prompt
(its policy text, without tool schemas for the trainer) so that the shared prefix is thousands of tokens long as in
a real run.
"""

from __future__ import annotations

import datasets
import pytest
import torch

from tau2_rl.backends import TransformersBackend, trl_prefix
from tau2_rl.backends import shared_prefix as shared_prefix_module
from tau2_rl.backends.attention import grouped_decode_attention
from tau2_rl.backends.shared_prefix import SharedPrefixTransformersBackend
from tau2_rl.configs import MultiTurnGRPOConfig
from tau2_rl.domains import get_domain
from tau2_rl.envs.episode import DomainEnv, EnvConfig
from tau2_rl.envs.runner import run_episodes
from tau2_rl.envs.users import get_user_simulator
from tau2_rl.rewards.outcome import outcome_reward
from tau2_rl.rollout import TokenPolicyAgent
from tau2_rl.trainers.multiturn_grpo import MultiTurnGRPOTrainer

AIRLINE = get_domain("airline")

pytestmark = pytest.mark.usefixtures("single_thread")

TASKS = ["0", "1", "2", "3"]  # shrunk: 4 episodes


def test_grouped_decode_attention_equals_sdpa_with_repeated_keys():
    """One decoding step with a padding mask: grouped queries over unrepeated keys == sdpa over repeated keys."""
    torch.manual_seed(0)
    batch, heads, kv_heads, length, dim = 3, 4, 2, 37, 16
    query = torch.randn(batch, heads, 1, dim)
    key, value = torch.randn(batch, kv_heads, length, dim), torch.randn(batch, kv_heads, length, dim)
    mask = torch.ones(batch, 1, 1, length, dtype=torch.bool)
    mask[1, ..., 5:9] = False  # a row with padding in the middle (prefix | padding | rest)
    mask[2, ..., :3] = False
    repeated_k = key.repeat_interleave(heads // kv_heads, dim=1)
    repeated_v = value.repeat_interleave(heads // kv_heads, dim=1)
    expected = torch.nn.functional.scaled_dot_product_attention(query, repeated_k, repeated_v, attn_mask=mask)
    got, _ = grouped_decode_attention(query, key, value, mask, None)
    torch.testing.assert_close(got, expected.transpose(1, 2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-cpu-kernel", "matmuls"])
def test_shared_prefix_attention_equals_sdpa_over_prefix_and_rows(monkeypatch, fused):
    """The cascade attention (prefix once, batch 1; each row's own keys masked) == sdpa over the concatenation."""
    torch.manual_seed(1)
    batch, heads, kv_heads, q_len, own_len, prefix_len, dim = 3, 4, 2, 5, 9, 40, 16
    prefix = torch.randn(1, kv_heads, prefix_len, dim), torch.randn(1, kv_heads, prefix_len, dim)
    module = torch.nn.Module()
    setattr(module, shared_prefix_module.PREFIX_ATTRIBUTE, prefix)
    query = torch.randn(batch, heads, q_len, dim)
    key, value = torch.randn(batch, kv_heads, own_len, dim), torch.randn(batch, kv_heads, own_len, dim)
    mask = torch.rand(batch, 1, q_len, own_len) > 0.3
    mask[0, 0, 0] = False  # a query that sees none of its row's own keys (left padding): the prefix alone
    if not fused:
        monkeypatch.setattr(shared_prefix_module, "_FUSED_CPU", None)
    monkeypatch.setattr(shared_prefix_module, "MAX_SCORE_ELEMENTS", 256)  # several query chunks
    got, _ = shared_prefix_module.shared_prefix_attention(module, query, key, value, mask)
    groups = heads // kv_heads
    full_keys = torch.cat([prefix[0].expand(batch, -1, -1, -1), key], 2).repeat_interleave(groups, dim=1)
    full_values = torch.cat([prefix[1].expand(batch, -1, -1, -1), value], 2).repeat_interleave(groups, dim=1)
    full_mask = torch.cat([torch.ones(batch, 1, q_len, prefix_len, dtype=torch.bool), mask], -1)
    expected = torch.nn.functional.scaled_dot_product_attention(query, full_keys, full_values, attn_mask=full_mask)
    torch.testing.assert_close(got, expected.transpose(1, 2), atol=1e-5, rtol=1e-5)


def _play(env, tokenizer, backend, batched: bool, turn_tokens: int = 8) -> list[list[int]]:
    """Completion ids of the 4 episodes, played in one wave-batched run or one episode at a time."""
    eos = tokenizer.eos_token_id
    agent = TokenPolicyAgent(backend, tokenizer, [eos], 4096, turn_tokens)
    specs = [(task_id, seed) for seed, task_id in enumerate(TASKS)]
    episodes = []
    for group in [specs] if batched else [[spec] for spec in specs]:
        group_episodes = [env.reset(task_id, seed) for task_id, seed in group]
        run_episodes(env, agent, get_user_simulator("scripted"), group, episodes=group_episodes, score=outcome_reward)
        episodes.extend(group_episodes)
    return [ep.agent_state["completion_ids"] for ep in episodes]


# shrunk from 30 turns; 16-turn episodes run 14 turns and repeat the 3-turn check at length (-m exhaustive)
HORIZONS = [3, pytest.param(16, marks=[pytest.mark.slow, pytest.mark.exhaustive])]


@pytest.mark.parametrize("max_turns", HORIZONS)
def test_wave_batched_prefix_reuse_equals_one_at_a_time_plain_generate(tiny_model_dir, tiny_tokenizer, max_turns):
    from transformers import AutoModelForCausalLM

    tok = tiny_tokenizer
    env = DomainEnv(AIRLINE, config=EnvConfig(max_turns=max_turns))  # the real ~7k-token prompt
    forced = {"forced_eos_token_id": tok.eos_token_id}  # every 8-token turn ends the turn: full multi-turn episodes
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    plain = TransformersBackend(model, tok, temperature=0.0, prefix_cache=False, generation_kwargs=forced)
    expected = _play(env, tok, plain, batched=False)
    for turn_cache_tokens in (1 << 20, 0):  # turn caching on (the default), then every history re-prefilled
        shared = SharedPrefixTransformersBackend(
            model, tok, temperature=0.0, generation_kwargs=forced, turn_cache_tokens=turn_cache_tokens
        )
        try:
            assert _play(env, tok, shared, batched=True) == expected
            assert shared.enabled and shared.checked  # the cascade attention ran (its self-check passed)
            assert shared.prefix_stats["built"] == 1 and shared.prefix_stats["prefix_tokens"] > 1000
            if turn_cache_tokens:
                stats = shared.turn_cache_stats  # later turns prefilled only what the environment added
                assert stats["reused_tokens"] > stats["prefilled_tokens"] and stats["diverged"] == 0
            else:
                assert shared.turn_cache_stats == {}
            # one at a time: turn caching on a one-row batch; off: the one-row path (materialised prefix, grouped
            # decode attention); once, at the short horizon (the 16-turn references cost a minute on CPU)
            if max_turns < 16:
                assert _play(env, tok, shared, batched=False) == expected
            else:
                assert shared.turn_cache_stats == {} or shared.turn_cache_stats["dropped"] == 0
        finally:
            shared.close()
    assert model.config._attn_implementation != shared_prefix_module.ATTENTION_NAME
    assert all(len(ids) > 20 * max_turns for ids in expected)  # really multi-turn: user/tool messages between turns


def _trainer(tmp_path, model_dir, tokenizer, prefix_reuse: bool, max_turns: int = 3) -> MultiTurnGRPOTrainer:
    from transformers import AutoModelForCausalLM

    env = DomainEnv(AIRLINE, config=EnvConfig(max_turns=max_turns))  # shrunk from 30
    env.tools = []  # shrunk: the policy text alone (thousands of tokens) is the shared prefix
    args = MultiTurnGRPOConfig(
        output_dir=str(tmp_path / "out"),
        variant="vanilla",
        per_device_train_batch_size=4,  # shrunk from 8: one group
        num_generations=4,  # shrunk from 8
        max_completion_length=2048,  # shrunk from 8192 (16 turns fit)
        max_turn_tokens=8,  # shrunk from 512
        # greedy, so that both generation paths must agree token for token; forced eos ends every 8-token turn
        generation_kwargs={"do_sample": False, "forced_eos_token_id": tokenizer.eos_token_id},
        rollout_prefix_reuse=prefix_reuse,
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=0,
    )
    rows = [{"prompt": [{"role": "system", "content": env.system_prompt}], "task_id": t} for t in TASKS]
    return MultiTurnGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        args=args,
        env=env,
        user=get_user_simulator("scripted"),
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer,
        reward_funcs=[lambda completions, **kwargs: [0.0] * len(completions)],
    )


def _rollout(trainer: MultiTurnGRPOTrainer) -> list[list[int]]:
    trainer._rollout_rows = [trainer.train_dataset[i] for i in range(len(TASKS))]
    _, completion_ids, *_ = trainer._generate([None] * len(TASKS))
    return completion_ids


@pytest.mark.parametrize("max_turns", HORIZONS)
def test_trainer_rollouts_with_prefix_reuse_equal_trls_generation(
    tmp_path, tiny_model_dir, tiny_tokenizer, monkeypatch, max_turns
) -> None:
    reference = _trainer(tmp_path / "trl", tiny_model_dir, tiny_tokenizer, prefix_reuse=False, max_turns=max_turns)
    assert trl_prefix.unavailable(reference) == "--rollout_prefix_reuse is false"
    expected = _rollout(reference)

    trainer = _trainer(tmp_path / "prefix", tiny_model_dir, tiny_tokenizer, prefix_reuse=True, max_turns=max_turns)
    assert trl_prefix.unavailable(trainer) is None
    attention = trainer.model.config._attn_implementation
    built = []
    original = SharedPrefixTransformersBackend._build_prefix
    monkeypatch.setattr(SharedPrefixTransformersBackend, "_build_prefix",
                        lambda self, prefix: built.append(len(prefix)) or original(self, prefix))  # fmt: skip
    monkeypatch.setattr(trainer, "_generate_single_turn", None)  # TRL's call must not be used on this path
    assert _rollout(trainer) == expected
    assert built and built[0] > 1000  # the rollout did start from a cached system-prompt prefix
    assert trainer.model.config._attn_implementation == attention  # restored before the loss sees the model
    assert all(len(ids) > 20 * max_turns for ids in expected)  # user/tool messages between the turns
    stats = trainer._turn_cache_stats  # the round's turn-cache counters (turn caching is on by default)
    assert stats["reused_tokens"] > stats["prefilled_tokens"] and stats["dropped"] == 0


def test_trainer_keeps_trls_call_when_the_decoding_rule_reads_the_prompt(tmp_path, tiny_model_dir, tiny_tokenizer):
    trainer = _trainer(tmp_path, tiny_model_dir, tiny_tokenizer, prefix_reuse=True)
    trainer.generation_config.repetition_penalty = 1.2
    assert "repetition penalty" in trl_prefix.unavailable(trainer)


def test_the_trl_internals_the_prefix_path_relies_on_still_exist(tmp_path, tiny_model_dir, tiny_tokenizer):
    """Pinned to trl==1.16.0: ``tau2_rl.backends.trl_prefix`` reads these; a TRL upgrade must keep them."""
    import inspect

    from trl.models.utils import unwrap_model_for_generation

    parameters = inspect.signature(unwrap_model_for_generation).parameters
    for name in ("gather_deepspeed3_params", "generation_kwargs", "gradient_checkpointing_kwargs"):
        assert name in parameters
    trainer = _trainer(tmp_path, tiny_model_dir, tiny_tokenizer, prefix_reuse=True)
    for name in ("generation_config", "generation_kwargs", "eos_token_ids", "use_vllm", "_dist", "model_wrapped"):
        assert hasattr(trainer, name), name
    assert hasattr(trainer._dist, "is_zero3") and hasattr(trainer.args, "ds3_gather_for_generation")

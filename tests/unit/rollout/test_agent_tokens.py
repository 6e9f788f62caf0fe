"""An agent's episode is trained on exactly the tokens that were sampled (rollout/agent_client.py).

The model is a stand-in here: `generate` replays scripted completions (token ids, log-probs and
policy versions chosen by the test) so that every token can be checked; the tokenizer and the
chat template are real (the tiny model's tokenizer with a Qwen3-style template that renders
tools, wraps tool results in <tool_response> and drops the <think> block of every assistant
turn before the last user message, as Qwen3's does).
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import numpy as np
import pytest

from tandem.rollout.agent import AgentResult, AgentSettings, agent_episodes
from tandem.rollout.agent_client import AgentClient, AgentUsageError, EpisodeLimit
from tandem.rollout.dataset import Prompt
from tandem.rollout.workflow import EpisodeContext, RejectGroup
from tandem.services.protocol import Ticket, Verdict
from tandem.trainer.buffer import validate

# Qwen3's template reduced to what matters here: tools in the system turn, tool results as a user
# turn of <tool_response> blocks, <think> kept only for assistant turns after the last real user
# message; the end of turn is the tokenizer's EOS (one token, as <|im_end|> is for Qwen3).
QWEN3_LIKE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}{%- for t in tools %}{{- '\\n' + (t | tojson) }}"
    "{%- endfor %}{{- '\\n</tools>' + eos_token + '\\n' }}{%- endif %}"
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or m.role == 'system' %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + eos_token + '\\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{%- set content = m.content %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}"
    "{%- set content = content.split('</think>')[-1] %}{%- endif %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_query and reasoning %}{{- '<think>' + reasoning + '</think>' }}{%- endif %}"
    "{{- content }}"
    "{%- for c in m.tool_calls or [] %}{{- '\\n<tool_call>\\n{\"name\": \"' + c.function.name + '\", \"arguments\": ' }}"
    "{{- c.function.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- eos_token + '\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- eos_token + '\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "Evaluate arithmetic.",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                         "required": ["expression"]}}}]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer
    t = AutoTokenizer.from_pretrained(tiny_model_dir)
    t.chat_template = QWEN3_LIKE
    return t


@dataclass
class Sampled:
    output_ids: list
    output_logprobs: list
    output_versions: list
    finish_reason: str = "stop"


class ScriptedModel:
    """Replays completions; records the context each request was sampled from."""

    def __init__(self, tok, texts: list[str], versions: list[list[int]] | None = None, eos: bool = True):
        self.tok, self.texts, self.versions, self.eos = tok, list(texts), versions, eos
        self.seen: list[list[int]] = []
        self.sampled: list[Sampled] = []

    async def generate(self, prompt_ids, params, key):
        self.seen.append(list(prompt_ids))
        k = len(self.sampled)
        ids = self.tok.encode(self.texts[k], add_special_tokens=False) + ([self.tok.eos_token_id] if self.eos else [])
        ids = ids[:params["max_new_tokens"]]
        rng = np.random.default_rng(k)
        versions = self.versions[k] if self.versions else [k] * len(ids)
        s = Sampled(ids, list(-rng.random(len(ids))), list(versions[:len(ids)]),
                    "stop" if self.eos and len(ids) and ids[-1] == self.tok.eos_token_id else "length")
        self.sampled.append(s)
        return s


SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 200}
THINK_CALL = '<think>13*15 is big, use the tool</think><tool_call>\n{"name": "calc", "arguments": {"expression": "13*15-7"}}\n</tool_call>'
ANSWER = "<think>the tool said 188</think>The answer is \\boxed{188}."


async def _calculator_episode(client, tools=TOOLS):
    messages = [{"role": "user", "content": "13*15-7=?"}]
    first = await client.chat.completions.create(messages=messages, tools=tools)
    call = first.choices[0].message.tool_calls[0]
    messages += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "188"}]
    second = await client.chat.completions.create(messages=messages, tools=tools)
    return messages + [second.choices[0].message.model_dump()], first, second


def test_tool_call_episode_trains_the_sampled_tokens_and_rerendering_would_not(tok):
    # the second reply's tokens were written by two policy versions (an interrupted request)
    n2 = len(tok.encode(ANSWER, add_special_tokens=False)) + 1
    model = ScriptedModel(tok, [THINK_CALL, ANSWER], versions=[[3] * 200, [3] * 5 + [4] * (n2 - 5)])
    client = AgentClient(model.generate, tok, SAMPLING, "g/0", max_turns=4, max_context=4096, tool_format="hermes")
    conversation, first, second = asyncio.run(_calculator_episode(client))

    reply = first.choices[0]
    assert reply.finish_reason == "tool_calls"
    assert reply.message.content == "<think>13*15 is big, use the tool</think>"
    assert (reply.message.tool_calls[0].function.name, json.loads(reply.message.tool_calls[0].function.arguments)) \
        == ("calc", {"expression": "13*15-7"})
    assert second.choices[0].message.content == ANSWER and second.choices[0].finish_reason == "stop"

    sampled = [s for s in client.segments if s.sampled]
    context = [s for s in client.segments if not s.sampled]
    # Trained tokens = the sampled ones, token for token, with their log-probs and versions.
    assert [s.ids for s in sampled] == [m.output_ids for m in model.sampled]
    assert [s.logprobs for s in sampled] == [m.output_logprobs for m in model.sampled]
    assert [s.versions for s in sampled] == [m.output_versions for m in model.sampled]
    # The second request continued the first one's exact tokens (no re-rendering).
    assert model.seen[1] == model.seen[0] + model.sampled[0].output_ids + context[0].ids
    # Between the turns: the tool result as the template renders it, then the generation prompt.
    assert tok.decode(context[0].ids) == "\n<|im_start|>user\n<tool_response>\n188\n</tool_response></s>\n" \
                                         "<|im_start|>assistant\n"
    # The drift exists: the template re-renders the first turn without its <think> block
    # (Qwen3 drops it once a later user turn exists; here the episode's own user turn counts).
    episode = client.prompt_ids + [t for s in client.segments for t in s.ids]
    rerendered = tok.apply_chat_template(conversation + [{"role": "user", "content": "thanks"}], tools=TOOLS,
                                         tokenize=True)
    rerendered = rerendered if isinstance(rerendered, list) else rerendered["input_ids"]
    assert "13*15 is big" in tok.decode(episode)
    assert "13*15 is big" not in tok.decode(rerendered)
    assert rerendered[:len(episode)] != episode


def _ctx(model, tok, n=2, grade=None):
    async def default_grade(items):
        return [Verdict(reward=1.0, correct=True, details={}) for _ in items]
    return EpisodeContext(generate=model.generate, grade=grade or default_grade, tokenizer=tok, n_samples=n,
                          sampling_params=SAMPLING)


def _prompt():
    return Prompt(id="p1", text="13*15-7=?", task="math", reference={"answer": "188"}, row={"level": 2})


def _settings(agent, **kw):
    return AgentSettings(agent=agent, max_turns=kw.get("max_turns", 4), context_tokens=kw.get("context", 4096),
                         timeout_s=kw.get("timeout_s", 30.0), limit_reward=-1.0, tool_format="hermes")


def test_agent_episodes_become_valid_trajectories_with_context_masked(tok):
    rows = []

    async def agent(row, client):
        rows.append(row)
        conversation, _, second = await _calculator_episode(client)
        verdict = await client.grade(second.choices[0].message.content)
        return AgentResult(verdict.reward, turn_rewards=[0.5, verdict.reward], details={"tool_calls": 1})

    model = ScriptedModel(tok, [THINK_CALL, ANSWER] * 2)
    trajs = asyncio.run(agent_episodes(_ctx(model, tok), _prompt(), Ticket(group_id="g", admit_version=7),
                                       settings=_settings(agent)))
    assert rows[0]["answer"] == "188" and rows[0]["level"] == 2 and rows[0]["prompt"] == "13*15-7=?"
    assert rows[0]["messages"][-1] == {"role": "user", "content": "13*15-7=?"}
    assert len(trajs) == 2
    for t in trajs:
        assert validate(t, vocab_size=len(tok)) is None
        trained = t.output_ids[t.output_mask == 1].tolist()
        assert trained == model.sampled[0].output_ids + model.sampled[1].output_ids
        assert np.all(t.output_logprobs[t.output_mask == 0] == 0)
        assert t.turn_rewards.tolist() == [0.5, 1.0] and t.reward == 1.0 and t.timings["tool_calls"] == 1.0


def test_history_cannot_be_edited(tok):
    async def agent(client):
        messages = [{"role": "user", "content": "13*15-7=?"}]
        first = await client.chat.completions.create(messages=messages, tools=TOOLS)
        edited = {"role": "assistant", "content": "I will use the calculator."}
        await client.chat.completions.create(messages=messages + [edited, {"role": "user", "content": "go"}],
                                             tools=TOOLS)
        return first

    client = AgentClient(ScriptedModel(tok, [THINK_CALL, ANSWER]).generate, tok, SAMPLING, "k", 4, 4096, "hermes")
    with pytest.raises(AgentUsageError, match=r"messages\[1\] \(assistant\) is not what the episode had"):
        asyncio.run(agent(client))


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": 0.7}, "differs from rollout.temperature"),
    ({"n": 2}, "n must be 1"),
    ({"stop": ["\n"]}, r"unsupported create\(\) arguments \['stop'\]"),
    ({"tool_choice": "required"}, "tool_choice='required' is not supported"),
])
def test_settings_that_would_mistrain_are_refused(tok, kwargs, message):
    client = AgentClient(ScriptedModel(tok, ["x"]).generate, tok, SAMPLING, "k", 4, 4096, "hermes")
    with pytest.raises(AgentUsageError, match=message):
        asyncio.run(client.chat.completions.create(messages=[{"role": "user", "content": "q"}], **kwargs))


def test_limits_end_an_episode_with_the_limit_reward_and_keep_its_tokens(tok):
    async def loops(row, client):   # never stops calling the tool
        messages = [{"role": "user", "content": row["prompt"]}]
        while True:
            reply = await client.chat.completions.create(messages=messages, tools=TOOLS)
            messages += [reply.choices[0].message, {"role": "tool", "content": "188"}]

    for settings, reason in ((_settings(loops, max_turns=3), "turn_limit"),
                             (_settings(loops, max_turns=9, context=600), "context_limit")):
        model = ScriptedModel(tok, [THINK_CALL] * 10)
        [t] = asyncio.run(agent_episodes(_ctx(model, tok, n=1), _prompt(), Ticket(group_id="g", admit_version=0),
                                         settings=settings))
        assert t.finish_reason == reason and t.reward == -1.0
        assert validate(t, vocab_size=len(tok)) is None
        assert t.output_ids[t.output_mask == 1].tolist() == [i for s in model.sampled for i in s.output_ids]
        assert len(t.prompt_ids) + len(t.output_ids) <= settings.context_tokens
        assert 2 <= len(model.sampled) < 9


def test_a_first_prompt_past_the_context_limit_rejects_the_group(tok):
    async def agent(row, client):
        await client.chat.completions.create(messages=[{"role": "user", "content": row["prompt"]}], tools=TOOLS)

    with pytest.raises(RejectGroup, match="leaves no room under the episode's context limit"):
        asyncio.run(agent_episodes(_ctx(ScriptedModel(tok, ["x"]), tok, n=1), _prompt(),
                                   Ticket(group_id="g", admit_version=0), settings=_settings(agent, context=50)))


def test_an_agent_that_catches_the_limit_gives_its_own_reward(tok):
    async def careful(row, client):
        messages = [{"role": "user", "content": row["prompt"]}]
        try:
            while True:
                reply = await client.chat.completions.create(messages=messages, tools=TOOLS)
                messages += [reply.choices[0].message, {"role": "tool", "content": "188"}]
        except EpisodeLimit as e:
            return AgentResult(0.25, details={"limit": e.reason == "turn_limit"})

    [t] = asyncio.run(agent_episodes(_ctx(ScriptedModel(tok, [THINK_CALL] * 5), tok, n=1), _prompt(),
                                     Ticket(group_id="g", admit_version=0), settings=_settings(careful, max_turns=2)))
    assert t.reward == 0.25 and t.timings["limit"] == 1.0 and t.timings["turns"] == 2.0


def test_a_hanging_agent_times_out_with_what_it_sampled(tok):
    async def hangs(row, client):
        await client.chat.completions.create(messages=[{"role": "user", "content": row["prompt"]}])
        await asyncio.sleep(3600)

    [t] = asyncio.run(agent_episodes(_ctx(ScriptedModel(tok, ["hm"]), tok, n=1), _prompt(),
                                     Ticket(group_id="g", admit_version=0), settings=_settings(hangs, timeout_s=0.2)))
    assert t.finish_reason == "timeout" and t.reward == -1.0 and t.output_mask.all()


async def _answers_yes(row, client):
    await client.chat.completions.create(messages=[{"role": "user", "content": "q"}])
    return "yes"


async def _never_asks(row, client):
    return 1.0


@pytest.mark.parametrize("agent, message", [(_answers_yes, "the agent returned str"),
                                            (_never_asks, "without asking the model anything")])
def test_an_agent_misused_fails_its_group_with_the_reason(tok, agent, message):
    with pytest.raises(AgentUsageError, match=message):
        asyncio.run(agent_episodes(_ctx(ScriptedModel(tok, ["a"]), tok, n=1), _prompt(),
                                   Ticket(group_id="g", admit_version=0), settings=_settings(agent)))

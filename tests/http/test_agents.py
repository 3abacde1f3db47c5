"""Agent frameworks in their default modes, against the shared 3-node ring of the real SmolLM2.

Each forces a tool call the way it does by default, parallel calls left allowed (every
API's default): instructor's TOOLS mode, the OpenAI Agents SDK with a required tool
over chat completions and over Responses, LangChain's ``bind_tools`` with a named
``tool_choice``, pydantic-ai's default output mode (a forced output tool) and
litellm's ``tool_choice="required"``. SmolLM2 at temperature 0 writes its call and then
repeats it: each framework gets the one call, parsed and validated as it parses it (the
engine's own format never reaches it as text). Each answer costs the ring ~25 tokens and
its prompt's prefill (here ~0.14 s a token, as much as ~25 decoded ones): so the tests that
declare the same tool come first and share their prompt's prefix, cached on the ring.
"""

from __future__ import annotations

import asyncio

import pytest
from pydantic import BaseModel

pytestmark = pytest.mark.slow

MODEL_ID = "smollm2"
QUESTION = "What is the weather in Paris right now?"
# Room for one call (24 tokens) and the start of the repeat SmolLM2 writes next, which is held
# back and dropped: each answer is the one call, finish tool_calls.
MAX_TOKENS = 26
# The one tool most of them declare, each in its own way: the ring's prompt lists it the same
# (render.tool_prompt), so after the first test the rest find their prompt's prefix cached.
WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


class Weather(BaseModel):
    # No docstring: pydantic would put it in the schema, and the prompt would differ from the others'.
    city: str


def get_weather(city: str) -> str:
    """The current weather of a city."""
    return f"sunny in {city}"


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_the_agents_sdks_required_tool_is_called(smollm2_ring, api):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # its traces go to OpenAI's servers
    client = AsyncOpenAI(base_url=smollm2_ring.base_url, api_key="not-needed", max_retries=0, timeout=120)
    model = OpenAIChatCompletionsModel(MODEL_ID, client) if api == "chat_completions" else OpenAIResponsesModel(MODEL_ID, client)
    called = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        called.append(city)
        return f"sunny in {city}"

    agent = Agent(
        name="forecaster", tools=[get_weather], model=model,
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=MAX_TOKENS),
        tool_use_behavior="stop_on_first_tool",  # the tool's answer is the run's: one turn of the model
    )  # fmt: skip
    result = asyncio.run(Runner.run(agent, QUESTION, max_turns=2))
    assert len(called) == 1 and called[0] and result.final_output == f"sunny in {called[0]}"


def test_litellms_required_tool_choice_gets_the_call(smollm2_ring, monkeypatch):
    import json

    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # else it fetches its price list from GitHub first
    import litellm

    tool = {"type": "function", "function": {"name": "get_weather", "description": get_weather.__doc__, "parameters": WEATHER_PARAMETERS}}
    response = litellm.completion(
        model="openai/" + MODEL_ID, api_base=smollm2_ring.base_url, api_key="not-needed", messages=[{"role": "user", "content": QUESTION}],
        tools=[tool], tool_choice="required", temperature=0, max_tokens=MAX_TOKENS,
    )  # fmt: skip
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    assert json.loads(choice.message.tool_calls[0].function.arguments)["city"]


def test_langchain_bind_tools_forced_gets_the_call(smollm2_ring):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=smollm2_ring.base_url, api_key="not-needed", model=MODEL_ID, temperature=0, max_tokens=MAX_TOKENS, max_retries=0)
    message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(QUESTION)
    assert [c["name"] for c in message.tool_calls] == ["get_weather"] and message.tool_calls[0]["args"]["city"]
    assert not message.content and not message.invalid_tool_calls


def test_instructor_tools_mode_gets_its_model(smollm2_ring):
    import instructor
    from pydantic import create_model

    # Its tool is the response model: named and described as the others' tool, it is that tool
    # (the prompt LangChain's forced call had, cached on the ring).
    model = create_model("get_weather", __doc__=get_weather.__doc__, city=(str, ...))
    client = instructor.from_openai(smollm2_ring.client(), mode=instructor.Mode.TOOLS)
    got = client.chat.completions.create(
        model=MODEL_ID, response_model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=MAX_TOKENS, temperature=0, max_retries=0
    )
    assert isinstance(got, model) and got.city


def test_pydantic_ais_default_output_type_comes_back(smollm2_ring):
    from pydantic_ai import Agent, ToolOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(MODEL_ID, provider=OpenAIProvider(base_url=smollm2_ring.base_url, api_key="not-needed"))
    # Its default output mode, a forced output tool (``final_result`` unless named), named and
    # described as the others' tool: the same prompt, cached on the ring.
    output = ToolOutput(Weather, name="get_weather", description=get_weather.__doc__)
    agent = Agent(model, output_type=output, model_settings={"temperature": 0, "max_tokens": MAX_TOKENS}, retries=0)
    got = agent.run_sync(QUESTION)
    assert isinstance(got.output, Weather) and got.output.city

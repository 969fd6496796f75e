"""The OpenAI Python SDK, pointed at fleetgate, as researchers use it."""

import openai
import pytest
from openai import OpenAI

from conftest import CHECKPOINT


@pytest.fixture()
def client(gateway):
    return OpenAI(base_url=gateway["base_url"], api_key=gateway["key"], max_retries=0)


def test_completion_with_vllm_extras_in_extra_body(client):
    resp = client.completions.create(
        model="llama-8b",
        prompt="The capital of France is",
        max_tokens=4,
        temperature=0.7,
        logprobs=5,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "prompt_logprobs": 5},
    )
    assert resp.object == "text_completion"
    assert resp.model == CHECKPOINT
    assert len(resp.choices) == 1
    choice = resp.choices[0]
    assert isinstance(choice.text, str)
    assert len(choice.logprobs.tokens) == resp.usage.completion_tokens
    assert choice.model_extra["prompt_logprobs"][0] is None
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_token_id_prompt_and_batch(client):
    resp = client.completions.create(model="llama-8b", prompt=[[1, 2, 3], [4, 5]], max_tokens=2, n=2)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert resp.usage.prompt_tokens == 5


def test_streaming_with_include_usage(client):
    chunks = list(client.completions.create(
        model="llama-8b", prompt="Once upon a time", max_tokens=6, stream=True,
        stream_options={"include_usage": True},
    ))
    content = [c for c in chunks if c.choices]
    assert content, "content chunks arrive"
    assert content[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 6
    text = "".join(c.choices[0].text for c in content)
    assert text


def test_streaming_without_include_usage_has_no_usage_frame(client):
    chunks = list(client.completions.create(model="llama-8b", prompt="Hi", max_tokens=3, stream=True))
    assert all(c.choices for c in chunks)


def test_unknown_model_is_model_not_found(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="no-such-model", prompt="Hi", max_tokens=1)
    assert err.value.code == "model_not_found"
    assert err.value.status_code == 400


def test_chat_is_chat_completions_unsupported(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="llama-8b", messages=[{"role": "user", "content": "Hi"}])
    assert err.value.code == "chat_completions_unsupported"


def test_strict_validation_reaches_the_sdk_as_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="llama-8b", prompt="Hi", max_tokens=1, temperature=200)
    assert err.value.code == "invalid_request"
    assert "temperature" in err.value.message


def test_request_id_header_and_bad_key(gateway):
    client = OpenAI(base_url=gateway["base_url"], api_key="fg-not-a-real-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        client.completions.create(model="llama-8b", prompt="Hi", max_tokens=1)
    assert err.value.code == "invalid_api_key"
    request_id = err.value.response.headers["x-request-id"]
    assert request_id.startswith("req_")
    assert err.value.response.json()["request_id"] == request_id


def test_models_list(client):
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids == ["llama-8b"]

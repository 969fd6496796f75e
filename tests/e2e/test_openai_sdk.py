"""The OpenAI Python SDK, pointed at fleetgate, as researchers use it."""

import openai
import pytest
from openai import OpenAI

import urllib.request

from conftest import CHECKPOINT, DEADLINE_FIT


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
    assert ids == ["llama-8b", "slow"]


def test_an_omitted_max_tokens_is_cut_to_the_request_window(client):
    raw = client.completions.with_raw_response.create(model="llama-8b", prompt="Hi")
    clamp = raw.headers["x-acs-max-tokens-clamped"]
    assert f"applied={DEADLINE_FIT},reason=deadline,source=default" in clamp
    assert raw.parse().usage.completion_tokens == DEADLINE_FIT


def test_deadline_infeasible_tells_the_sdk_not_to_retry(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="llama-8b", prompt="Hi", max_tokens=DEADLINE_FIT + 1)
    assert err.value.code == "deadline_infeasible"
    assert err.value.response.headers["x-should-retry"] == "false"
    assert "stream" in err.value.message
    # The same max_tokens streams fine.
    chunks = list(client.completions.create(
        model="llama-8b", prompt="Hi", max_tokens=DEADLINE_FIT + 1, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"


def _deadline_overruns(gateway):
    """fleetgate_upstream_requests_total of the slow node with outcome="deadline"."""
    with urllib.request.urlopen(gateway["root"] + "/metrics", timeout=10) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith("fleetgate_upstream_requests_total{") and 'gpu="gpu-slow"' in line \
                and 'outcome="deadline"' in line:
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


def test_upstream_deadline_is_a_504_the_sdk_does_not_retry(gateway):
    # The SDK's default: up to two retries of a 5xx, unless the response says not to.
    client = OpenAI(base_url=gateway["base_url"], api_key=gateway["key"], max_retries=2)
    before = _deadline_overruns(gateway)
    with pytest.raises(openai.InternalServerError) as err:
        # 100 tokens at 50 ms each: 5 s, over the 2 s window.
        client.completions.create(model="slow", prompt="Hi", max_tokens=100)
    assert err.value.status_code == 504
    assert err.value.code == "upstream_deadline"
    assert err.value.response.headers["x-should-retry"] == "false"
    assert "retry-after" not in err.value.response.headers
    assert _deadline_overruns(gateway) == before + 1, "sent upstream once: no retry"


def test_a_job_submitted_with_prefer_respond_async_is_harvested(client, gateway):
    import json

    from openai.types import Completion

    raw = client.completions.with_raw_response.create(
        model="llama-8b",
        prompt="Once upon a time",
        max_tokens=5,
        extra_headers={"Prefer": "respond-async", "Idempotency-Key": "sdk-job-1"},
    )
    assert raw.status_code == 202
    job = raw.http_response.json()
    assert job["object"] == "completion.job" and job["status"] == "queued"
    assert raw.headers["location"] == f"/v1/harvest/{job['id']}"

    # A retry with the same Idempotency-Key gets the same job.
    again = client.completions.with_raw_response.create(
        model="llama-8b",
        prompt="Once upon a time",
        max_tokens=5,
        extra_headers={"Prefer": "respond-async", "Idempotency-Key": "sdk-job-1"},
    )
    assert again.status_code == 200 and again.http_response.json()["id"] == job["id"]

    harvest = urllib.request.Request(
        f"{gateway['root']}{raw.headers['location']}?wait=10",
        headers={"Authorization": f"Bearer {gateway['key']}"},
    )
    for _ in range(10):
        with urllib.request.urlopen(harvest, timeout=20) as response:
            job = json.load(response)
        if job["status"] not in ("queued", "running"):
            break
    assert job["status"] == "succeeded", job
    completion = Completion.model_validate(job["result"])
    assert completion.model == CHECKPOINT
    assert completion.usage.completion_tokens == 5

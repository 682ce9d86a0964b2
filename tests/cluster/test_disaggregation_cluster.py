"""Prefill/decode disaggregation on a real node: the operator runs a prefill pod beside the decode
pod; the openai client's answer is computed there first (the decode worker finds the prompt's KV
already cached: it pulled it from the prefill pod), and it equals, token for token, the answer of
the decode pod computing the prompt alone (greedy). Turning disaggregation off removes the prefill
pool."""

from __future__ import annotations

import openai
import pytest

from tests.cluster.conftest import WATCHED, Platform, wait_pods_ready
from tests.cluster.workloads import IDEPS, deploy, patch_spec, register, tenant_key, undeploy, wait_served
from tests.k8s.cluster import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]
NAME = "chat-split"
PREFILL = f"inferplane.io/deployment={NAME}-prefill"
DECODE = f"inferplane.io/deployment={NAME}"
PROMPT = ("You are a careful assistant. Summarise the following notes in one sentence. " +
          " ".join(f"Note {i}: the lighthouse keeper logged the storm at hour {i}." for i in range(12)))


def test_a_disaggregated_deployment_answers_as_its_decode_pod_alone(platform: Platform, model_server: str) -> None:
    register(platform, model_server)
    keys = [tenant_key(platform, "split-a"), tenant_key(platform, "split-b")]
    deploy(platform, NAME, "cpu-int8", disaggregation={"enabled": True, "minPrefillTokens": 0})
    try:
        wait_pods_ready(platform, WATCHED, PREFILL, 1)
        wait_pods_ready(platform, WATCHED, DECODE, 1)
        wait_served(platform, keys[0], NAME, timeout=900)

        def ask(key: str, prompt: str = PROMPT) -> openai.types.Completion:
            client = openai.OpenAI(base_url=f"{platform.gateway_url}/v1", api_key=key, max_retries=0, timeout=600)
            return client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0)

        probes = iter(range(1000))

        def probe(key: str) -> bool:
            """Whether a prompt never sent before came back cached: computed by the prefill pod."""
            text = f"Probe {next(probes)}: " + "count the waves on the shore, one by one, slowly. " * 8
            usage = ask(key, text).usage
            return usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens - 16

        # The prefill pod Ready is not yet routed: the gateway lists EndpointSlices every 2 s.
        wait_for(lambda: probe(keys[0]), 300, "the gateway sending prompts through the prefill pod", interval=3)
        split = ask(keys[0])
        assert split.usage.prompt_tokens > 64
        # The decode pod computed none of the prompt's full blocks: they came from the prefill pod.
        assert split.usage.prompt_tokens_details.cached_tokens >= split.usage.prompt_tokens - 16, split.usage
        assert split.usage.completion_tokens == 24

        # The decode pod alone: every prompt skips the prefill pool; another tenant, whose cache is
        # its own, so the decode pod computes the whole prompt.
        patch_spec(platform, NAME, {"disaggregation": {"enabled": True, "minPrefillTokens": 100000}})
        wait_for(lambda: not probe(keys[1]), 300, "the gateway's decider sending prompts to the decode pod alone",
                 interval=5)
        alone = ask(keys[1])
        assert alone.choices[0].text == split.choices[0].text

        patch_spec(platform, NAME, {"disaggregation": {"enabled": False}})
        wait_for(lambda: not platform.pods(WATCHED, PREFILL), 600, "the prefill pool removed", interval=2)
        assert platform.node.cluster.get(f"/apis/apps/v1/namespaces/{WATCHED}/deployments/{NAME}-prefill") is None
        assert (platform.node.cluster.get(f"{IDEPS}/{NAME}") or {}).get("spec", {}).get("replicas") == 1
    finally:
        undeploy(platform, NAME)

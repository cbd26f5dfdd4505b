"""Two simulated Ray nodes on one machine: prefill placed on one, decode on the other by custom
resources; the answer is still transformers' greedy text and no page stays held."""

from __future__ import annotations

from typing import Any

import openai
import pytest
import ray
from ray.cluster_utils import Cluster

from cluster.serve import start_cluster
from tests.cluster.cluster_fixtures import hf_greedy_ids, local_config, wait_no_pages_held

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_nodes() -> Any:
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": False},
    )
    cluster.add_node(num_cpus=1, resources={"prefill_node": 1}, node_ip_address="127.0.0.1")
    cluster.add_node(num_cpus=1, resources={"decode_node": 1}, node_ip_address="127.0.0.1")
    ray.init(address=cluster.address, namespace="duet-two-nodes", _node_ip_address="127.0.0.1")
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_prefill_and_decode_on_different_nodes(two_nodes, hf_gguf_model) -> None:
    from engine.loaders import load_tokenizer

    cfg = local_config(
        prefill={"resources": {"num_cpus": 1, "num_gpus": 0, "resources": {"prefill_node": 1}}},
        decode={"resources": {"num_cpus": 1, "num_gpus": 0, "resources": {"decode_node": 1}}},
    )
    running = start_cluster(cfg)
    try:
        p_node = ray.get(running.handles.prefill[0].handle.node_id.remote())
        d_node = ray.get(running.handles.decode[0].handle.node_id.remote())
        assert p_node != d_node
        tok = load_tokenizer("default")
        client = openai.OpenAI(
            base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=120
        )
        model = client.models.list().data[0].id
        for prompt in ("The capital of France is", "Write a haiku about the sea."):
            ids = hf_greedy_ids(hf_gguf_model, tok.encode(prompt), 16, sorted(tok.stop_token_ids))
            r = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)
            assert r.choices[0].text == tok.decode(ids, skip_special_tokens=True)
        wait_no_pages_held(running)
    finally:
        running.stop()

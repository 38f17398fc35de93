"""Two local Ray Serve replicas of the specdec server (runs only when ray[serve] is installed:
pip install "specdec[ray]")."""

import socket

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_replicas_serve_the_same_greedy_text():
    import httpx
    import openai

    from specdec import SpeculativeDecoder, load
    from specdec.defaults import default_model
    from specdec.serving.ray_app import deployment

    expected = SpeculativeDecoder(load(default_model("target"))).generate("def f(x):", max_new_tokens=8).text
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(deployment(num_replicas=2, num_cpus=0.5, model_name="toy"), route_prefix="/")
        status = serve.status().applications["default"].deployments["SpecdecReplica"]
        assert status.replica_states == {"RUNNING": 2}
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        for _ in range(4):
            reply = client.completions.create(model="toy", prompt="def f(x):", max_tokens=8, temperature=0)
            assert reply.choices[0].text == expected
        pids = {httpx.get(f"http://127.0.0.1:{port}/health").json()["pid"] for _ in range(30)}
        assert len(pids) == 2  # both replicas answer
    finally:
        serve.shutdown()
        ray.shutdown()

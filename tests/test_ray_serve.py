"""Two local Ray Serve replicas of the specdec server, deployed as `serve run ...:app_builder` deploys
them (its key=value arguments as text), answering through the openai client with an API key
(runs only when ray[serve] is installed: pip install "specdec[ray]"; .ci/run installs it)."""

import socket

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Ray once hung starting a worker on an overloaded machine (load 4, the test at nice 19): a hang
# fails this test in 10 minutes instead of holding CI to its limit.
@pytest.mark.timeout(600, method="thread")
def test_two_replicas_serve_the_same_greedy_text():
    import httpx
    import openai

    from specdec import SpeculativeDecoder, load
    from specdec.defaults import default_model
    from specdec.serving.ray_app import app_builder

    expected = SpeculativeDecoder(load(default_model("target"))).generate("def f(x):", max_new_tokens=8).text
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(app_builder({"num_replicas": "2", "num_cpus": "0.5", "model_name": "toy", "api_key": "k"}),
                  route_prefix="/")
        status = serve.status().applications["default"].deployments["SpecdecReplica"]
        assert status.replica_states == {"RUNNING": 2}
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
        for _ in range(4):
            reply = client.completions.create(model="toy", prompt="def f(x):", max_tokens=8, temperature=0)
            assert reply.choices[0].text == expected
        streamed = client.completions.create(model="toy", prompt="def f(x):", max_tokens=8, temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in streamed) == expected  # server-sent events through Ray
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 401  # no key, no answer
        replicas = {httpx.get(f"http://127.0.0.1:{port}/health").json()["replica"] for _ in range(30)}
        assert len(replicas) == 2  # both replicas answer
    finally:
        serve.shutdown()
        ray.shutdown()

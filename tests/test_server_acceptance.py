"""The server's "acceptance" request field (LOSSY opt-in, docs/acceptance.md): validated to a 400,
marked in the response (the "specdec" object, and a streamed choice's last chunk), counted in
/metrics, and the server's --acceptance default for requests that name none."""

import json

import httpx
import pytest

from specdec import SpeculativeDecoder, load, make_drafter
from specdec.core.acceptance import LOSSY_PRESET
from specdec.defaults import default_model
from specdec.serving.app import ServerLimits
from specdec.serving.in_thread import serve_in_thread
from specdec.serving.server import build_app

MODEL = "toy"
PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add("
LOOSE = "topk:k=20,delta=0"  # keeps nearly every draft among the target's 20 most likely tokens


@pytest.fixture(scope="module")
def target():
    return load(default_model("target"), dtype="float64")


def serve(target, **options):
    app = build_app(target, make_drafter("ngram"), MODEL, speculation="on", max_batch=4,
                    limits=ServerLimits(max_tokens=64), **options)
    return serve_in_thread(app)


def completion(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 24,
                                                     "temperature": 0, **body}, timeout=120)


def relaxed_metric(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=60).text.splitlines():
        if line.startswith("specdec:spec_decode_num_relaxed_accepted_tokens_total"):
            return float(line.split()[-1])
    raise AssertionError("no relaxed-acceptance counter in /metrics")


@pytest.mark.parametrize("acceptance", ["fuzzy", "topk:k=0", "typical:alpha=-1", "topk:delta=high"])
def test_a_bad_acceptance_gets_a_400_naming_the_field(target, acceptance):
    with serve(target) as url:
        response = completion(url, acceptance=acceptance)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "acceptance" and "\n" not in error["message"]
        assert completion(url).status_code == 200


def test_responses_say_how_they_were_verified(target):
    """Exact by default, and the target alone's text; a lossy request is marked in its "specdec"
    object with the drafts only its rule kept, which /metrics counts too."""
    alone = SpeculativeDecoder(target).generate(PROMPT, max_new_tokens=24).text
    with serve(target) as url:
        exact = completion(url).json()
        assert exact["choices"][0]["text"] == alone
        assert exact["specdec"]["acceptance"] == "exact"
        assert exact["specdec"]["lossy"] is False and exact["specdec"]["relaxed_accepted"] == 0
        assert relaxed_metric(url) == 0
        lossy = completion(url, acceptance=LOOSE).json()["specdec"]
        assert lossy["acceptance"] == LOOSE and lossy["lossy"] is True and lossy["relaxed_accepted"] > 0
        assert relaxed_metric(url) == lossy["relaxed_accepted"]
        preset = completion(url, acceptance="lossy").json()["specdec"]
        assert preset["acceptance"] == LOSSY_PRESET


def test_a_streamed_lossy_choice_is_marked_as_it_ends(target):
    with serve(target) as url:
        def events(**body) -> list[dict]:
            with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
                    "model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stream": True, **body}) as r:
                return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]

        lossy = events(acceptance=LOOSE, n=2)
        marked = [event for event in events(acceptance=LOOSE) + lossy if "specdec" in event]
        assert len(marked) == 3 and all(event["choices"][0]["finish_reason"] for event in marked)
        assert all(event["specdec"]["acceptance"] == LOOSE for event in marked)
        assert not any("specdec" in event for event in events())  # exact streams are as they were


def test_the_server_default_applies_to_requests_that_name_none(target):
    with serve(target, default_acceptance="lossy") as url:
        assert completion(url).json()["specdec"]["acceptance"] == LOSSY_PRESET
        assert completion(url, acceptance="exact").json()["specdec"]["acceptance"] == "exact"

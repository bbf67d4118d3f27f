"""`orlhf serve-rm`: loopback by default, bearer token, OpenRLHF's JSON format, and HttpReward against it."""

import threading

import pytest
import requests

from orlhf.demo import ensure_demo
from orlhf.rewards import HttpReward, RewardError
from orlhf.serve_rm import make_server


@pytest.fixture
def server():
    srv = make_server(str(ensure_demo().reward_fn), port=0, token="s3cret")
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_binds_loopback_by_default(server):
    assert server.server_address[0] == "127.0.0.1"


def test_token_required_and_rewards_served(server):
    url = f"http://127.0.0.1:{server.server_address[1]}/get_reward"
    body = {"query": ["say colors: red blue", "say colors: cat"], "prompts": ["say colors:"] * 2,
            "labels": ["colors", "colors"]}
    assert requests.post(url, json=body, timeout=10).status_code == 401
    assert requests.post(url, json=body, headers={"Authorization": "Bearer nope"}, timeout=10).status_code == 401
    ok = requests.post(url, json=body, headers={"Authorization": "Bearer s3cret"}, timeout=10)
    assert ok.status_code == 200 and ok.json()["rewards"] == [1.0, 0.0]  # "red blue": 2/2 colors; "cat": 0
    bad = requests.post(url, data=b"{not json", headers={"Authorization": "Bearer s3cret"}, timeout=10)
    assert bad.status_code == 400

    rewards = HttpReward(url, token="s3cret").score(body["query"], body["prompts"], body["labels"])
    assert rewards.tolist() == [1.0, 0.0]
    with pytest.raises(RewardError, match="401|token"):
        HttpReward(url, token="wrong", retries=0).score(body["query"], body["prompts"], body["labels"])

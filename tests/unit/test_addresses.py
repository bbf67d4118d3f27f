"""distributed/addresses.py: which interface a rendezvous uses, as NCCL_SOCKET_IFNAME users expect."""

import pytest

from orlhf.distributed.addresses import SPEC_ENV, AddressError, choose, matches, requested_spec

# A host with a docker bridge first, the cluster's network second, as `ip addr` lists them.
IFACES = {"lo": "127.0.0.1", "docker0": "172.17.0.1", "eth0": "10.0.0.5", "eth1": "192.168.9.5"}


def test_specs_read_as_nccl_socket_ifname():
    assert matches("eth", "eth0") and matches("eth", "eth1") and not matches("eth", "docker0")
    assert matches("docker,eth", "docker0")
    assert not matches("^docker,lo", "docker0") and not matches("^docker,lo", "lo") and matches("^docker,lo", "eth1")
    assert matches("=eth0", "eth0") and not matches("=eth0", "eth0.100") and matches("eth0", "eth0.100")


def test_a_spec_picks_the_first_matching_interface_and_says_so():
    assert choose("eth", None, IFACES) == ("10.0.0.5", "eth0", "--socket_ifname eth")
    assert choose("^docker,lo", "10.0.0.1", IFACES).interface == "eth0"
    assert choose("=eth1", "10.0.0.1", IFACES).ip == "192.168.9.5"


def test_a_spec_no_interface_matches_names_the_interfaces_and_the_flag():
    with pytest.raises(AddressError, match=r"no interface of \S+ matches --socket_ifname ib.*eth0 10\.0\.0\.5"):
        choose("ib", "10.0.0.1", IFACES)


def test_without_a_spec_the_route_to_the_head_decides():
    # The route to loopback leaves from loopback: the one route every machine has.
    assert choose(None, "127.0.0.1", IFACES) == ("127.0.0.1", "lo", "the route to the Ray head 127.0.0.1")
    assert choose(None, None, IFACES).ip == "127.0.0.1"  # no Ray cluster: this host only


def test_the_request_comes_from_the_flag_else_the_users_gloo_or_nccl_variables():
    assert requested_spec({}) is None
    assert requested_spec({"NCCL_SOCKET_IFNAME": "^docker"}) == "^docker"
    assert requested_spec({"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "^docker"}) == "=eth1"  # gloo: exact
    assert requested_spec({SPEC_ENV: "eth", "GLOO_SOCKET_IFNAME": "eth1"}) == "eth"

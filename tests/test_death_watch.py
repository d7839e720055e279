"""The death watch a follower holds on its leader (``ziplog.io.death_watch``): only a
connection that delivered the leader's token and then ended counts as a death; a stop,
a wrong token, or a listener that is full never does, and the beat data a follower
parses from ZooKeeper is read totally."""

from __future__ import annotations

import socket
import threading

from hypothesis import given, strategies as st

from ziplog.io.death_watch import MAX_WATCHERS, TOKEN_BYTES, DeathWatch, DeathWatchListener, parse_beat

WAIT_S = 30  # far beyond what any step takes: only a broken watch waits that long


def _watch(beat: tuple[str, int, bytes]) -> tuple[DeathWatch, threading.Event, threading.Event]:
    died, watching = threading.Event(), threading.Event()
    return DeathWatch(*beat, on_death=died.set, on_watching=watching.set), died, watching


def _beat(listener: DeathWatchListener) -> tuple[str, int, bytes]:
    beat = parse_beat(listener.data)
    assert beat is not None
    return beat


def _try_connect(listener: DeathWatchListener) -> socket.socket | None:
    """A stranger's connection that read its token (the listener holds it), or None when
    the listener closed it before the token (it was full)."""
    host, port, token = _beat(listener)
    sock = socket.create_connection((host, port), timeout=WAIT_S)
    got = b""
    while len(got) < TOKEN_BYTES:
        part = sock.recv(TOKEN_BYTES)
        if not part:
            sock.close()
            return None
        got += part
    assert got == token
    return sock


def _connected(listener: DeathWatchListener) -> socket.socket:
    sock = _try_connect(listener)
    assert sock is not None, "the listener closed a connection within its bound"
    return sock


def test_the_end_of_the_leaders_listener_is_a_death() -> None:
    listener = DeathWatchListener("127.0.0.1", None)
    try:
        watch, died, watching = _watch(_beat(listener))
        assert watching.wait(WAIT_S), "the watch never read the leader's token"
        assert not died.is_set()
    finally:
        listener.close()
    assert died.wait(WAIT_S)
    assert watch.finished.wait(WAIT_S)


def test_a_stopped_watch_or_a_wrong_token_is_no_death() -> None:
    listener = DeathWatchListener("127.0.0.1", None)
    try:
        host, port, token = _beat(listener)
        wrong, wrong_died, wrong_watching = _watch((host, port, bytes(TOKEN_BYTES)))
        assert wrong.finished.wait(WAIT_S)
        assert not wrong_watching.is_set()
        stopped, stopped_died, stopped_watching = _watch((host, port, token))
        assert stopped_watching.wait(WAIT_S)
        stopped.stop()
        assert stopped.finished.wait(WAIT_S)
    finally:
        listener.close()
    assert not wrong_died.is_set() and not stopped_died.is_set()


def test_a_full_listener_refuses_before_the_token_and_deposes_nobody() -> None:
    listener = DeathWatchListener("127.0.0.1", None)
    strangers: list[socket.socket] = []
    try:
        strangers = [_connected(listener) for _ in range(MAX_WATCHERS)]
        watch, died, watching = _watch(_beat(listener))
        assert watch.finished.wait(WAIT_S), "a watch past the bound was held"
        assert not died.is_set() and not watching.is_set()
        # A stranger that leaves frees its place (once the listener read its leaving:
        # a connection refused meanwhile ends at once, and the next one is tried).
        strangers.pop().close()
        for _ in range(1000):
            sock = _try_connect(listener)
            if sock is not None:
                strangers.append(sock)
                break
        else:
            raise AssertionError("a place freed by a stranger that left was never given again")
    finally:
        listener.close()
        for s in strangers:
            s.close()


def test_a_peer_that_sends_is_dropped_and_frees_its_place() -> None:
    listener = DeathWatchListener("127.0.0.1", None)
    try:
        rude = _connected(listener)
        rude.sendall(b"hello")  # a follower sends nothing
        rude.settimeout(WAIT_S)
        try:
            ended = rude.recv(64) == b""
        except ConnectionResetError:  # closed with the bytes unread: a reset
            ended = True
        assert ended, "the listener kept a peer that sent"
        rude.close()
        strangers = [_connected(listener) for _ in range(MAX_WATCHERS)]  # its place is free again
        for s in strangers:
            s.close()
    finally:
        listener.close()


@given(st.binary(max_size=200) | st.text(max_size=100).map(str.encode))
def test_beat_data_is_parsed_totally(data: bytes) -> None:
    beat = parse_beat(data)
    assert beat is None or (0 < beat[1] < 65536 and len(beat[2]) == TOKEN_BYTES)


def test_an_identifier_names_no_death_watch() -> None:
    assert parse_beat(b"0") is None and parse_beat(b"") is None and parse_beat(None) is None
    listener = DeathWatchListener("127.0.0.1", "10.1.2.3:99")
    try:
        assert _beat(listener)[0] == "10.1.2.3"  # the advertised host, with the listener's own port
    finally:
        listener.close()

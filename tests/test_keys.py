"""Key names: one hash tag per conversation, ids that cannot break it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.cluster import key_slot
from redis.crc import key_slot as crc_key_slot

from gateway.keys import ConvRef, Keys, enc


def test_conversation_keys_share_one_tag() -> None:
    """Every key of a conversation carries the same `{tenant:conversation}` hash tag."""
    keys = Keys()
    ref = ConvRef("t1", "c1")
    names = [*keys.conversation_keys(ref), keys.fold_lock(ref)]
    assert all(n.startswith("gw:{t1:c1}:") for n in names)
    assert keys.meta(ref) == "gw:{t1:c1}:meta"
    assert keys.project_state(ref) == "gw:{t1:c1}:state"


def test_project_state_key_is_scoped_to_tenant_and_project() -> None:
    """With a project id the state key is the project's, inside the tenant, not the conversation's."""
    keys = Keys("mg")
    assert keys.project_state(ConvRef("t", "c", "proj")) == "mg:{t:p:proj}:state"
    assert keys.project_state(ConvRef("t", "other", "proj")) == keys.project_state(ConvRef("t", "c", "proj"))
    assert keys.project_state(ConvRef("u", "c", "proj")) != keys.project_state(ConvRef("t", "c", "proj"))


def test_fold_stream_and_group_names() -> None:
    """The fold queue is one stream under the prefix, consumed by the `fold-workers` group."""
    assert Keys("gw").fold_stream() == "gw:folds"
    assert Keys.FOLD_GROUP == "fold-workers"


def test_enc_escapes_tag_breaking_characters() -> None:
    """Braces, colons, percent signs and control characters are percent-encoded, the rest kept."""
    assert enc("plain-id_1.2") == "plain-id_1.2"
    assert enc("a{b}c:d%e") == "a%7Bb%7Dc%3Ad%25e"
    assert enc("x\ny\x00") == "x%0Ay%00"
    assert enc("héllo") == "héllo"


def test_braces_and_colons_map_to_a_single_slot() -> None:
    """Ids with braces and colons still put all of a conversation's keys in one cluster slot."""
    keys = Keys()
    ref = ConvRef("te}n{ant:", "{conv}:x{")
    slots = {key_slot(k.encode()) for k in [*keys.conversation_keys(ref), keys.fold_lock(ref)]}
    assert len(slots) == 1
    assert slots == {crc_key_slot(keys.tag(ref).split("{", 1)[1].rsplit("}", 1)[0].encode())}


def test_prefix_with_braces_is_rejected() -> None:
    """A prefix that would itself become the hash tag is refused."""
    with pytest.raises(ValueError):
        Keys("g{w}")


@given(st.text(), st.text(), st.text(), st.text())
def test_distinct_ids_never_share_keys(t1: str, c1: str, t2: str, c2: str) -> None:
    """Two different (tenant, conversation) pairs never map to the same key, and the tag stays whole."""
    keys = Keys()
    a, b = keys.meta(ConvRef(t1, c1)), keys.meta(ConvRef(t2, c2))
    assert (a == b) == ((t1, c1) == (t2, c2))
    for name in (a, b):
        assert name.count("{") == 1 and name.count("}") == 1


@given(st.text(), st.text(), st.text())
def test_project_state_never_collides_with_a_conversation_key(t: str, c: str, p: str) -> None:
    """A project's state key can never equal a conversation's state key."""
    keys = Keys()
    assert keys.project_state(ConvRef(t, c, p or "x")) != keys.project_state(ConvRef(t, c))


def test_tags_are_remembered_within_a_bound() -> None:
    """Key names come out the same on every call while the remembered tags stay bounded."""
    keys = Keys()
    ref = ConvRef("t{1}", "c:%")
    first = keys.conversation_keys(ref)
    assert keys.conversation_keys(ref) == first and keys.conversation_keys(ref) is not first
    assert first[0] == "gw:{t%7B1%7D:c%3A%25}:meta"
    for i in range(5000):
        keys.meta(ConvRef("t", f"c{i}"))
    assert len(keys._tags) <= 4096
    assert keys.conversation_keys(ref) == first

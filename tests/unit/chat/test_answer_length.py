"""Each tier's answer length (ChatConfig.answer_length): max_answer_tokens for every tier until a
tier's own cap is set, which is then its default and the most a request may ask for."""

from __future__ import annotations

from typing import Any

from services.chat.config import AnswerLength, ChatConfig
from tandem.config import Settings, Tier


def config(**settings: Any) -> ChatConfig:
    return ChatConfig.from_settings(Settings(**settings))


def test_without_tier_caps_every_tier_defaults_to_max_answer_tokens_uncapped():
    lengths = config(max_answer_tokens=300).answer_lengths()
    assert lengths == {tier: AnswerLength(300, None) for tier in Tier}
    assert lengths[Tier.FREE].max_tokens(None) == 300
    assert lengths[Tier.FREE].max_tokens(5000) == 5000, "as before: only the window bounds what a request asks"


def test_a_tier_cap_is_that_tiers_default_and_its_ceiling_and_leaves_the_others_alone():
    chat = config(max_answer_tokens=300, max_answer_tokens_free=128, max_answer_tokens_pro=4096)
    free, plus, pro = (chat.answer_length(tier) for tier in (Tier.FREE, Tier.PLUS, Tier.PRO))
    assert (free.max_tokens(None), free.max_tokens(1000), free.max_tokens(50)) == (128, 128, 50)
    assert (plus.max_tokens(None), plus.max_tokens(1000)) == (300, 1000)
    assert (pro.max_tokens(None), pro.max_tokens(10000)) == (4096, 4096)


def test_the_settings_read_the_tier_caps_from_the_environment(monkeypatch):
    monkeypatch.setenv("TANDEM_MAX_ANSWER_TOKENS_PLUS", "700")
    assert config().answer_length(Tier.PLUS) == AnswerLength(700, 700)
    assert config().answer_length(Tier.FREE) == AnswerLength(512, None)

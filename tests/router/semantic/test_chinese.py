"""The text layer on Chinese and mixed Chinese/English questions: each trap class refused for its
reason in both directions, paraphrases and spacing variants not; Chinese numerals; the
multilingual embedder's routing; per-language thresholds; the shipped calibration.

The examples are the development split's kind (``tests/data/semantic/zh/dev.jsonl``, the split
the word lists were written from); the held-out report split is only scored, by
``bench/semantic_languages.py``."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from kvcached_router.semantic import calibrate as cal
from kvcached_router.semantic.chinese import numeral_value
from kvcached_router.semantic.embed import USE_SCRIPTS, AutoEmbedder, HashingEmbedder
from kvcached_router.semantic.features import analyse, language_group
from kvcached_router.semantic.guards import check, compare

DEV = os.path.join(os.path.dirname(__file__), "..", "..", "data", "semantic", "zh", "dev.jsonl")

REFUSED = [
    ("negation", "还没收到快递怎么办", "已经收到快递怎么办"),
    ("negation", "信用卡可以提前还款吗", "信用卡不可以提前还款吗"),
    ("negation", "会员能退款吗", "非会员能退款吗"),
    ("negation", "怎么开通信用卡", "信用卡怎么取消"),
    ("negation", "怎么打开蓝牙", "怎么关闭蓝牙"),
    ("negation", "网银怎么登录", "网银怎么退出登录"),
    ("negation", "空调制冷模式怎么设置", "空调制热模式怎么设置"),
    ("negation", "这件衣服有大码吗", "这件衣服有小码吗"),  # one character apart: 大/小
    ("negation", "如何放大图片", "如何缩小图片"),
    ("negation", "如何开通流量包", "如何退订流量包"),
    ("negation", "二手房需要交契税吗", "二手房免交契税吗"),
    ("entity", "从北京到上海的机票多少钱", "从上海到北京的机票多少钱"),  # the same places, swapped
    ("entity", "广州飞成都要多久", "成都飞广州要多久"),
    ("number", "三百五十元能买什么", "三百元能买什么"),
    ("number", "两个人的套餐多少钱", "3个人的套餐多少钱"),
    ("number", "Windows 10 怎么激活", "Windows 11 怎么激活"),
    ("date", "周一上午几点开门", "周二上午几点开门"),
    ("date", "明天北京会下雨吗", "今天北京会下雨吗"),
    ("entity", "MySQL 怎么备份数据库", "PostgreSQL 怎么备份数据库"),
    ("entity", "React 和 Vue 哪个好学", "Angular 和 Vue 哪个好学"),
    ("entity", "微信怎么转账", "支付宝怎么转账"),
    ("entity", "北京的护照怎么办理", "上海的护照怎么办理"),
    ("scope", "儿童票怎么买", "成人票怎么买"),
    ("scope", "全部退款后优惠券会退回吗", "部分退款后优惠券会退回吗"),
    ("language", "怎么重置密码", "How do I reset my password?"),
]

ACCEPTED = [
    ("怎么修改登录密码", "如何更改登录密码"),
    ("MySQL 怎么备份数据库", "怎样给 MySQL 数据库做备份"),
    ("这个不锈钢锅不错吗", "这款不锈钢锅好不好"),
    ("三百五十元能买什么", "350元能买什么"),
    ("两个人的套餐多少钱", "2个人的套餐多少钱"),
    ("一万五的工资交多少税", "15000的工资交多少税"),
    ("5G 套餐怎么办理", "5G套餐怎么办理"),
    ("网页显示HTTP 404是什么意思", "网页显示HTTP404是什么意思"),
    ("是否可以提前还款", "能不能提前还款"),
    ("Kubernetes 的 Pod 一直重启怎么排查", "Kubernetes 的 Pod 不停重启怎么排查"),
    ("Excel 怎么冻结首行", "Excel 怎么冻结第一行"),
    ("5G 套餐每月多少钱", "5G 套餐月租是多少"),
    ("订单已经发货了吗", "我的订单发货了没有"),  # 了没有 asks, it does not negate
    ("这个药饭前吃还是饭后吃", "这个药饭后吃还是饭前吃"),  # the same two choices
    ("从北京到上海的机票多少钱", "北京到上海的机票多少钱"),
]


@pytest.mark.parametrize("reason, a, b", REFUSED)
def test_each_chinese_trap_is_refused_for_its_reason_both_ways(reason, a, b):
    for q, c in ((a, b), (b, a)):
        r = check(q, c, USE_SCRIPTS)
        assert r is not None and r.reason == reason, (q, c, r)


@pytest.mark.parametrize("a, b", ACCEPTED)
def test_chinese_paraphrases_and_spacing_variants_pass_the_guards(a, b):
    assert check(a, b, USE_SCRIPTS) is None and check(b, a, USE_SCRIPTS) is None


def test_chinese_is_read_letter_for_letter_only_by_an_embedder_that_cannot_read_it():
    a, b = "怎么修改登录密码", "如何更改登录密码"
    assert check(a, b, USE_SCRIPTS) is None
    r = check(a, b)  # MiniLM's scripts: Chinese letters must be identical
    assert r is not None and r.reason == "language"


@pytest.mark.parametrize("text, value", [
    ("三百五十", "350"), ("一百五", "150"), ("两千三", "2300"), ("一万五", "15000"), ("两万", "20000"),
    ("十五", "15"), ("三百零五", "305"), ("百分之五", "5%"), ("三分之一", "1/3"), ("第三", "#3"),
    ("二〇二四", "2024"),
])
def test_chinese_numerals(text, value):
    assert numeral_value(text) == value


def test_fixed_words_with_negation_or_numeral_characters_are_not_cues_or_numbers():
    f = analyse("这个不锈钢锅不错，未来一起用")
    assert f.negations == 0 and f.numbers == ()
    assert analyse("百度和三星哪个好").numbers == ()
    assert analyse("我不想退款").negations == 1


def test_language_groups():
    assert [language_group(analyse(t)) for t in ("怎么退款", "MySQL 怎么备份", "How do I pay?")] == ["zh", "mixed", "en"]


class _Stub:
    """A stand-in model: a fixed direction per call, to see which half of the vector it fills."""

    def __init__(self, dim: int, value: float) -> None:
        self.dim, self.value, self.calls = dim, value, []

    def encode(self, texts):
        self.calls.append(list(texts))
        return np.full((len(texts), self.dim), self.value, dtype=np.float32)


def test_the_auto_embedder_routes_chinese_to_one_model_and_the_rest_to_the_other():
    minilm, use = _Stub(384, 1.0), _Stub(512, 1.0)
    e = AutoEmbedder(minilm=minilm, use=use)
    v = e.encode(["How do I pay?", "怎么付款", "MySQL 怎么备份"])
    assert v.shape == (3, 896) and minilm.calls == [["How do I pay?"]] and use.calls == [["怎么付款", "MySQL 怎么备份"]]
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0)
    assert float(v[0] @ v[1]) == 0.0 and float(v[1] @ v[2]) == pytest.approx(1.0)  # never across models


def test_per_language_thresholds_are_chosen_and_used():
    pairs = []
    for i in range(40):
        pairs.append(cal.Pair(f"订单{i}怎么取消", f"订单{i}如何取消", True, "paraphrase"))
        pairs.append(cal.Pair(f"How do I cancel order {i}?", f"How can I cancel order {i}?", True, "paraphrase"))
    scored = cal.score(pairs, HashingEmbedder())
    c = cal.calibrate(scored, 0.02, model="hashing-v1", dim=256, min_group_pairs=30)
    assert set(c.languages) == {"zh", "en"}
    tier = scored[0].tier
    assert c.threshold(tier, "zh") == c.languages["zh"][tier] and c.threshold(tier, "mixed") == c.thresholds[tier]
    assert c.lowest_threshold == min(c.threshold(t, g) for t in c.thresholds for g in ("", "zh", "en"))
    again = cal.Calibration.from_dict(json.loads(json.dumps(c.to_dict())))
    assert again.languages == c.languages


def test_the_shipped_calibration_is_for_the_default_embedder_and_has_chinese_thresholds():
    shipped = cal.shipped_calibration(AutoEmbedder.name)
    assert shipped is not None and shipped.target == 0.02 and {"zh", "mixed", "en"} <= set(shipped.languages)
    assert cal.shipped_calibration("all-MiniLM-L6-v2") is None  # made for another embedder: not used


def test_the_dev_split_is_well_formed():
    with open(DEV) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    assert len(rows) >= 200 and {r["lang"] for r in rows} == {"zh", "mixed", "en"}
    assert all(isinstance(r["same_answer"], bool) for r in rows)


def test_compare_takes_the_readable_scripts():
    q, c = analyse("怎么修改登录密码"), analyse("如何更改登录密码")
    assert compare(q, c, USE_SCRIPTS).refusal is None and compare(q, c).refusal is not None

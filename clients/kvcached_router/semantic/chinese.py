"""Reading the Chinese runs of a text for the guards: words, negation cues, antonyms' words,
numbers (Chinese numerals included), dates, named entities and audiences.

:func:`read` takes the whole normalised text and reads only its Han characters; the Latin words,
digits and punctuation around them are the English reader's (``features.py`` splits a text at
script boundaries, so ``5G套餐`` is ``5G`` and ``套餐`` however it is spaced).

Words come from ``jieba`` (its dictionary ships in the package; loaded once per process, about
0.7 s, on the first Chinese text). Negation is counted on characters, not on jieba's words: a
segmenter splits 还没收到 as 还 / 没收 / 到 ("confiscate"), and the cue would be lost; the fixed
words in which 不, 没, 未, 别, 无, 非 do not negate (不错, 未来, 特别, 无线, ...) are masked first.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from . import lexicon_zh as zh
from .frame import slots

#: Han characters (the basic block, extension A, compatibility ideographs): what this reader reads.
HAN = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
HAN_RUN = re.compile(f"[{HAN}]+")
_NUMERAL_CHARS = "".join(zh.DIGITS) + "".join(zh.UNITS) + "".join(zh.BIG_UNITS)
_NUMERAL = re.compile(f"第?[{_NUMERAL_CHARS}]+(?:分之[{_NUMERAL_CHARS}]+)?|百分之[{_NUMERAL_CHARS}]+")
_WEEKDAY = re.compile("(?:周|星期|礼拜)([一二三四五六日天末])")
_MASK_NEG = re.compile("|".join(sorted(map(re.escape, zh.NOT_NEGATING), key=len, reverse=True)))
_MASK_NUM = re.compile("|".join(sorted(map(re.escape, zh.NOT_NUMBERS), key=len, reverse=True)))
_MASK_AUDIENCE = re.compile("|".join(sorted(map(re.escape, zh.NOT_AUDIENCES), key=len, reverse=True))
                            + "|[0-9一二两三四五六七八九十几每哪这那]个人")
_FILLERS = re.compile("|".join(sorted(map(re.escape, zh.FILLER_PHRASES), key=len, reverse=True)))
_AUDIENCE_WORDS = sorted(((w, g) for g, words in enumerate(zh.AUDIENCES) for w in words.split()),
                         key=lambda wg: len(wg[0]), reverse=True)
#: jieba's part-of-speech tags of names: places, organisations, people, and the names added
#: here (its own "nz", other proper nouns, tags many common nouns: 驾驶证, 五日游).
_NAME_TAGS = frozenset({"ns", "nt", "nr", "brand"})
#: Names jieba does not know or tags as common nouns: brands, apps, services people ask about.
USER_NAMES = (
    "微信 支付宝 淘宝 天猫 京东 拼多多 抖音 快手 小红书 美团 饿了么 滴滴 高德 百度 知乎 微博 钉钉 飞书 企业微信 "
    "华为 小米 荣耀 苹果 三星 联想 比亚迪 特斯拉 蔚来 理想 小鹏 吉利 长城 大众 丰田 本田 "
    "工商银行 建设银行 农业银行 中国银行 招商银行 交通银行 邮储银行 浦发银行 中信银行 "
    "移动 联通 电信 顺丰 中通 圆通 韵达 申通 京东物流 菜鸟 携程 飞猪 去哪儿 "
    "花呗 借呗 余额宝 微粒贷 白条"
).split()


GENERIC_LATIN = zh.GENERIC_LATIN
_ALIAS_OF = {name: group for group in zh.ALIASES for name in group}


def aliases(name: str) -> tuple[str, ...]:
    """Every name of the product ``name`` names (itself when it has no alias)."""
    return _ALIAS_OF.get(name.lower(), (name,))


def has_han(text: str) -> bool:
    return HAN_RUN.search(text) is not None


@dataclass
class ChineseReading:
    """What :func:`read` found in one text's Han runs."""

    words: list[str] = field(default_factory=list)  # jieba's words, in order
    content: list[str] = field(default_factory=list)  # words that carry meaning (question words canonical)
    cues: list[str] = field(default_factory=list)  # negation characters, with a little context
    negated: set[str] = field(default_factory=set)  # what each negation cue negates (see _negated)
    numbers: list[str] = field(default_factory=list)  # canonical values ("350", "2", "5%", "#3")
    dates: set[str] = field(default_factory=set)
    frequencies: set[str] = field(default_factory=set)  # 每月 -> monthly
    entities: set[str] = field(default_factory=set)
    audiences: dict[int, str] = field(default_factory=dict)  # zh.AUDIENCES group -> word
    nouns: set[str] = field(default_factory=set)  # the words jieba tags as nouns (see frame_refusal)
    spans: set[str] = field(default_factory=set)  # units of spans of time after a number ("day", "month")


_jieba_lock = threading.Lock()
_posseg = None


def _segmenter():
    """jieba's part-of-speech segmenter, loaded once (thread-safe), with :data:`USER_NAMES`."""
    global _posseg
    if _posseg is None:
        with _jieba_lock:
            if _posseg is None:
                import jieba
                import jieba.posseg as posseg

                jieba.setLogLevel(logging.WARNING)
                for name in USER_NAMES:
                    jieba.add_word(name, freq=2000, tag="brand")
                jieba.initialize()
                _posseg = posseg
    return _posseg


def read(text: str) -> ChineseReading:
    """Read the Han runs of ``text`` (already normalised)."""
    r = ChineseReading()
    han = " ".join(HAN_RUN.findall(text))
    if not han:
        return r
    _read_cues(han, r)
    rest = _read_dates(han, r)
    _read_numbers(rest, r)
    _read_audiences(text, r)
    r.spans.update(_SPAN_UNIT[u] for u in _SPAN.findall(text))
    for run in _FILLERS.sub(" ", han).split(" "):
        for pair in _segmenter().cut(run):
            w, tag = pair.word, pair.flag
            r.words.append(w)
            if (tag in _NAME_TAGS and len(w) >= 2 and w not in zh.FUNCTION_WORDS and w not in zh.DATE_WORDS
                    and w not in zh.FILLER_PHRASES and w not in zh.NOT_NAMES):
                r.entities.add(w)
            if ((tag[:1] == "n" or tag in ("brand", "j")) and w not in zh.FUNCTION_WORDS and w not in zh.DATE_WORDS
                    and w not in zh.FILLER_PHRASES and w not in zh.QUESTION_WORDS):
                r.nouns.add(w)
            if w in zh.QUESTION_WORDS:
                q = zh.QUESTION_WORDS[w]
                if q:
                    r.content.append(q)
            elif w not in zh.FUNCTION_WORDS and not _NUMERAL.fullmatch(w):
                r.content.append(w)
    return r


def _read_cues(han: str, r: ChineseReading) -> None:
    masked = _MASK_NEG.sub(lambda m: "_" * len(m.group()), han)
    for i, ch in enumerate(masked):
        if ch in zh.NEGATION_CHARS:
            r.cues.append(han[i:i + 2])
            _negated(han, i + 2 if han[i:i + 2] == "没有" else i + 1, r)
    for w in zh.NEGATION_WORDS:  # 拒绝退还: as 不退
        start = han.find(w)
        while start >= 0:
            r.cues.append(w)
            _negated(han, start + len(w), r)
            start = han.find(w, start + 1)


def _negated(han: str, at: int, r: ChineseReading) -> None:
    """What a negation cue ending before ``at`` negates: the next two characters (没到账 ->
    到账; 没有工资条 -> 工资), or the one before the text or clause ends (工资没发 -> 发)."""
    after = han[at:at + 2].split(" ")[0]  # the Han runs are joined by spaces: a clause ends there
    if after and not any(c in zh.NEGATION_CHARS for c in after):
        r.negated.add(after)


def _read_dates(han: str, r: ChineseReading) -> str:
    """Weekdays and date words into ``r.dates``; returns ``han`` with them blanked (周一 is no 1)."""
    def weekday(m: re.Match) -> str:
        day = m.group(1)
        r.dates.add("周末" if day == "末" else f"周{'日' if day == '天' else day}")
        return " " * len(m.group())

    rest = han
    for w, f in zh.FREQUENCY_WORDS.items():
        if w in rest:
            r.frequencies.add(f)
            rest = rest.replace(w, " " * len(w))
    rest = _WEEKDAY.sub(weekday, rest)
    for w in sorted(zh.DATE_WORDS, key=len, reverse=True):
        if w in rest:
            r.dates.update(zh.DATE_ALIASES.get(w, w).split())
            rest = rest.replace(w, " " * len(w))
    return rest


_ONE_SPAN = frozenset({"个月", "个小", "个星", "个礼", "个季", "个周", "个钟"})
_LONE_UNITS = frozenset("百千万亿")
#: A lone 一 before the measure word of a thing (一张, 一台, 一件, 一层): 1, but compared only with
#: another number. Before a span, a sum or a time (一天, 一次, 一元) it is a count.
WEAK_ONE = "1?"
_ARTICLE_MEASURES = frozenset("张台件层")
#: A number of days, weeks, months, years, hours or minutes (第三天 / 第三个月): the unit is the
#: span's class, compared as the English "after 2 weeks" / "after 2 months" are.
_SPAN = re.compile(f"(?:[0-9{_NUMERAL_CHARS}]+|几|多少)\\s*(天|日|周|星期|礼拜|个月|个星期|年|小时|个小时|钟头|分钟)")
_SPAN_UNIT = {"天": "day", "日": "day", "周": "week", "星期": "week", "礼拜": "week", "个星期": "week",
              "个月": "month", "年": "year", "小时": "hour", "个小时": "hour", "钟头": "hour", "分钟": "minute"}


def _read_numbers(han: str, r: ChineseReading) -> None:
    for w in zh.FIRST_WORDS:  # 首行 is the first row (第一行)
        if w in han:
            r.numbers.append("#1")
            han = han.replace(w, " ")
    masked = _MASK_NUM.sub(lambda m: " " * len(m.group()), han)
    for m in _NUMERAL.finditer(masked):
        s = m.group()
        after = masked[m.end():m.end() + 1]
        if (s == "一" and (not after or after not in zh.ONE_MEASURES)  # 一个, 一下: "a", not a count
                and masked[m.end():m.end() + 2] not in _ONE_SPAN):  # but 一个月 is 1个月
            continue
        if s in _LONE_UNITS:  # 万豪, 千岛湖: a name's character, not 10000
            continue
        value = numeral_value(s)
        if value is not None:
            # 重新办一张, 蒙了一层水汽: a lone "one X" is an article as often as a count: WEAK_ONE
            # counts only against another number (guards._number)
            r.numbers.append(WEAK_ONE if s == "一" and after in _ARTICLE_MEASURES else value)


def numeral_value(s: str) -> str | None:
    """The canonical value of a Chinese numeral: ``三百五十`` -> ``350``, ``两万`` -> ``20000``,
    ``百分之五`` -> ``5%``, ``三分之一`` -> ``1/3``, ``第三`` -> ``#3``, ``一二三`` (digit by digit)
    -> ``123``; None when it is not one."""
    if s.startswith("百分之"):
        v = _integer(s[3:])
        return None if v is None else f"{v}%"
    if s.startswith("第"):
        v = _integer(s[1:])
        return None if v is None else f"#{v}"
    if "分之" in s:
        den, num = s.split("分之", 1)
        a, b = _integer(num), _integer(den)
        return None if a is None or b is None else f"{a}/{b}"
    v = _integer(s)
    return None if v is None else str(v)


def _integer(s: str) -> int | None:
    if not s:
        return None
    if all(ch in zh.DIGITS for ch in s):  # 一二三, 二〇二四: digit by digit
        return int("".join(str(zh.DIGITS[ch]) for ch in s))
    total, section, digit = 0, 0, None
    for ch in s:
        if ch in zh.DIGITS:
            digit = zh.DIGITS[ch]
        elif ch in zh.UNITS:
            section += (1 if digit is None else digit) * zh.UNITS[ch]
            digit = None
        elif ch in zh.BIG_UNITS:
            section += digit or 0
            total += (section or 1) * zh.BIG_UNITS[ch]
            section, digit = 0, None
        else:
            return None
    if digit is not None:
        # 一百五 is 150, 两千三 2300, 一万五 15000: a digit right after a unit is one unit lower
        unit = {**zh.UNITS, **zh.BIG_UNITS}.get(s[-2], 0) if len(s) >= 2 else 0
        section += digit * (unit // 10 if unit >= 100 else 1)
    return total + section


def _read_audiences(text: str, r: ChineseReading) -> None:
    """The audiences named in ``text`` (the whole text: 2个人 is "two people", not 个人)."""
    rest = _MASK_AUDIENCE.sub(" ", text)
    for w, g in _AUDIENCE_WORDS:
        if w in rest:
            r.audiences.setdefault(g, w)
            rest = rest.replace(w, " ")


def antonym_refusal(q_words: Iterable[str], q_text: str, c_words: Iterable[str], c_text: str) -> str | None:
    """The antonym pair that tells two Chinese texts apart (one side's word on one, the other
    side's on the other, neither on both), or None. Multi-character words are matched in the
    text, single characters as whole words of the segmentation."""
    qw, cw = set(q_words), set(c_words)

    def has(word: str, words: set[str], text: str) -> bool:
        return word in words if len(word) == 1 else word in text

    def without(text: str, words: tuple[str, ...], mine: tuple[str, ...]) -> str:
        """``text`` less the other side's words that contain one of ``mine`` (退出登录 is no 登录)."""
        for w in words:
            if len(w) > 1 and any(m in w for m in mine):
                text = text.replace(w, " ")
        return text

    for left, right in _ANTONYM_SIDES:
        # A pair refuses only when each text has one of its words: most pairs are in neither.
        if not (any(w in q_text for w in left + right) and any(w in c_text for w in left + right)):
            continue
        q_left, q_right = without(q_text, right, left), without(q_text, left, right)
        c_left, c_right = without(c_text, right, left), without(c_text, left, right)
        ql = [w for w in left if has(w, qw, q_left)]
        qr = [w for w in right if has(w, qw, q_right)]
        cl = [w for w in left if has(w, cw, c_left)]
        cr = [w for w in right if has(w, cw, c_right)]
        if ql and cr and not qr and not cl:
            return f"{ql[0]}/{cr[0]}"
        if qr and cl and not ql and not cr:
            return f"{qr[0]}/{cl[0]}"
    return None


_ANTONYM_SIDES = tuple((tuple(a.split()), tuple(b.split())) for a, b in zh.ANTONYMS)


_CHAR_OPPOSITE = {pair[i]: pair[1 - i] for pair in zh.CHAR_ANTONYMS for i in (0, 1)}


def char_antonym_refusal(q_text: str, c_text: str) -> str | None:
    """The opposite characters that tell two Chinese texts apart when nothing else does: with
    their common start and end removed, what is left is at most two characters on each side, as
    many on both, and at one place a pair of :data:`lexicon_zh.CHAR_ANTONYMS` (这件衣服有大码吗 /
    这件衣服有小码吗: 大/小). Words the segmenter keeps whole (大码) escape the word lists; a longer
    difference is the word lists' and the threshold's to judge (饭前还是饭后 / 饭后还是饭前 is the
    same question)."""
    n = 0
    while n < min(len(q_text), len(c_text)) and q_text[n] == c_text[n]:
        n += 1
    m = 0
    while m < min(len(q_text), len(c_text)) - n and q_text[-1 - m] == c_text[-1 - m]:
        m += 1
    dq, dc = q_text[n:len(q_text) - m], c_text[n:len(c_text) - m]
    if not 0 < len(dq) == len(dc) <= 2:
        return None
    for a, b in zip(dq, dc):
        if _CHAR_OPPOSITE.get(a) == b:
            return f"{a}/{b}"
    return None


_TO = "(?:" + "|".join(sorted(map(re.escape, zh.ROUTE_WORDS), key=len, reverse=True)) + ")"
_PLACE = "([\u4e00-\u9fff]{2,6}?)"
_AFTER = "(?=的|[^\u4e00-\u9fff]|坐|乘|怎么|要|需要|多|几|吗|$)"
_ROUTES = (re.compile("从" + _PLACE + _TO + _PLACE + _AFTER), re.compile("^" + _PLACE + _TO + _PLACE + _AFTER))


def route(text: str) -> tuple[str, str] | None:
    """(from, to) of a trip a Chinese text names (从北京到上海的机票, 北京飞上海要多久 ->
    (北京, 上海)), or None: after 从 anywhere, else at the start of the text. Only compared
    between two texts (:func:`guards._entity`: the same two places, swapped)."""
    for pattern in _ROUTES:
        m = pattern.search(text)
        if m:
            return m.group(1), m.group(2)
    return None


_UNDO = "取消|解除|撤销|撤回|停止"
_UNDONE = re.compile("(?:" + _UNDO + ")掉?(?:[^\u4e00-\u9fff]|别人的|他人的|对方的|所有的|某个|某一|这个|那个|的)*"
                     "([^了的吗呢吧啊后时就掉\u0000-\u4dff\ua000-\uffff][\u4e00-\u9fff])")
_STOPS = re.compile(_UNDO + "|停止|停用|关闭|关掉|退订|退掉|注销|不再|不要|删除|去掉|禁用|作废|撤|解冻|解锁|解绑|解封|解禁|解约")


def undo_refusal(q_text: str, c_text: str) -> str | None:
    """取消 (解除, 撤销, 撤回, 停止) X on one side, X without any undoing on the other: the opposite
    actions (把别人静音 / 取消别人的静音, 隐藏某一列 / 取消隐藏某一列), for every X, not only the
    pairs :data:`lexicon_zh.ANTONYMS` lists. Not when the other side stops or removes in other
    words (停止自动续费 / 取消自动续费 ask the same)."""
    for mine, other in ((q_text, c_text), (c_text, q_text)):
        if _STOPS.search(other):
            continue
        for m in _UNDONE.finditer(mine):
            if m.group(1) in other:
                return f"{m.group(1)}/{m.group(0).strip()}"
    return None


def affirms(text: str, words: Iterable[str]) -> bool:
    """Whether ``text`` says one of ``words`` without a negation character right before it."""
    for w in words:
        start = text.find(w)
        while start >= 0:
            if (start == 0 or text[start - 1] not in zh.NEGATION_CHARS) and text[max(0, start - 2):start] != "没有":
                return True
            start = text.find(w, start + 1)
    return False


_NOT_FRAME = re.compile(r"[\s\W_]+")
#: Characters written either way (帐户 / 账户).
_VARIANTS = str.maketrans({"帐": "账"})
#: Characters of asking and grammar, never a frame's slot on their own; negation characters and
#: numerals too (their guards compare them: 一直不 / 没, 两 / 2).
_LIGHT = re.compile(f"[的了吗呢吧啊呀么嘛哦我你您他她它们这那个些怎如何样咋啥什为可以能够会要想需得该应请问是否有在把被给和与及或"
                    f"还也都就才又再很太更最一直0-9{zh.NEGATION_CHARS}{_NUMERAL_CHARS}]")
#: A slot with a number in it is the number guard's (三百元以上 / 满300元).
_NUMERIC = re.compile(f"[0-9{_NUMERAL_CHARS}]")
#: Words that ask for one act (停止 / 取消 自动续费): one slot filled either way is one question.
_SAME_ACT = {w: i for i, group in enumerate(zh.SAME_ACT) for w in group.split()}
#: A frame is this much of the longer text at least, and this many characters.
FRAME_SHARE = 0.4
FRAME_MIN_CHARS = 4


def frame_refusal(q_text: str, q_nouns: Iterable[str], c_text: str, c_nouns: Iterable[str]) -> str | None:
    """Two Chinese questions in one frame (a shared beginning and end, at least
    :data:`FRAME_SHARE` of the longer text) that each put a noun the other lacks in it, two
    characters at least (钱 / 月租 is one question): the same question about another thing
    (父母的住院费用 / 配偶的住院费用, 牙齿多久清洁一次 / 耳朵多久清洁一次, 国家电网的电费 /
    南方电网的电费, 年终奖需要缴税吗 / 经济补偿金需要缴税吗). A frame with an insertion only
    (我的信用卡 / 信用卡) is not this rule's; nor a noun on one side only."""
    qs, cs = (_NOT_FRAME.sub("", t.lower()).translate(_VARIANTS) for t in (q_text, c_text))
    shared, raw_q, raw_c = slots(qs, cs)
    if shared < max(FRAME_MIN_CHARS, FRAME_SHARE * max(len(qs), len(cs))) or not raw_q or not raw_c:
        return None
    only_q = sorted(w for w in q_nouns if len(w) >= 2 and w.translate(_VARIANTS) not in cs)
    only_c = sorted(w for w in c_nouns if len(w) >= 2 and w.translate(_VARIANTS) not in qs)
    if only_q and only_c:
        return f"{only_q[0]} vs {only_c[0]}"
    # A short slot in a frame of half the text at least (健身房有游泳课吗 / 健身房有瑜伽课吗), its
    # function characters left out (怎么 / 如何 are no slot)
    if shared >= max(FRAME_MIN_CHARS, 0.5 * max(len(qs), len(cs))) and not _NUMERIC.search(raw_q + raw_c):
        slot_q, slot_c = _LIGHT.sub("", raw_q), _LIGHT.sub("", raw_c)
        if (slot_q and slot_c and len(slot_q) <= 4 and len(slot_c) <= 4
                and slot_q not in slot_c and slot_c not in slot_q  # 饭前 / 饭前吃: moved, not another
                and (len(slot_q) + len(slot_c) > 2 or (slot_q + slot_c).isascii())  # 装 / 转: a slip of the IME
                and _SAME_ACT.get(slot_q, -1) != _SAME_ACT.get(slot_c, -2)):
            return f"{slot_q} vs {slot_c}"
    return None

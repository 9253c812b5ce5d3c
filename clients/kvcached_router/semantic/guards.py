"""Guards: reasons to refuse a semantic match however similar the two embeddings are.

An embedding scores "Is the clinic open on Sundays?" and "Is the clinic closed on Sundays?" at
0.93, and most Chinese questions at 1.000 (MiniLM reads their characters as [UNK]). The guards
compare what embeddings blur, and refuse when it differs:

============  =====================================================================================
reason        refuses when
============  =====================================================================================
language      the two texts are in two languages (Chinese vs English: the answer is in the asker's
              language), their main scripts differ, or the letters of a script the embedder cannot
              read differ at all (with MiniLM: CJK, Hangul, Arabic, ... only match letter for letter);
              and whenever either text is in a language these guards have no word lists for
              (:data:`GUARDED_LANGUAGES`: English and Chinese): Spanish, Japanese, Russian, ... are
              served by the exact path only, since nothing here would see "activar" / "desactivar"
              or "アップロード" / "ダウンロード" differ; plain ASCII whose words are mostly not
              English ones counts as another language
slot          both texts are ``label: value`` with the same label and another value (or the same
              value under another label), their quoted spans differ, or both name a member of a
              closed class and not the same ones: sizes, diets, seats, beds, delivery speeds,
              gearboxes, ways to pay (medium / large, vegan / halal, window / aisle, cash / card);
              in Chinese colours, languages, spice levels and ways to pay (白色 / 蓝色, 中文 / 韩文,
              微辣 / 特辣); or they are one question with another word in its slot: the same
              words before and after one to three others ("reset the router's admin
              password" / "... wifi password"; words of one meaning, :data:`lexicon.SYNONYMS`,
              and the words of asking, "how" / "best way", do not count), in Chinese one frame
              with another noun or a short slot in it (报销牙科费用 / 报销眼科费用, 有游泳课 / 有瑜伽课)
number        the numbers differ (digits, number words: "two" = 2, "£50" is not "50 USD"; in Chinese a
              lone 一 before a thing's measure word, 重新办一张, counts only against another number),
              or both texts name units or currencies and not the same ones (tablespoons /
              teaspoons, km / miles, dollars / euros)
date          weekdays, months, "tomorrow", "next week", am/pm differ, or each text names a span of
              time the other does not ("after 2 weeks" / "after 2 months"; 第三天 / 第三个月)
negation      the count of negation cues differs ("don't", "never", "without", "hardly", "lacks",
              "unless", "other than", "too big to", "rejected", "declined", "denied", "missing", "stop X from",
              ...; 不, 没,
              未, 别, 无, 非 outside fixed words like 不错, 未来), or a word on one side has its
              antonym on the other (open/closed, eat/avoid, enable/disable, include/exclude, into/out,
              remember/forget, follow/ignore, manage/fail;
              开通/取消, 上传/下载, 冻结/解冻; in Chinese also opposite characters one place apart,
              大码/小码; 取消 X against X, 把别人静音/取消别人的静音) unless one of the two is negated
              ("broken" / "isn't working"), or its negated form
              (lock/unlock, refundable/non-refundable, activate/deactivate, spelled/misspelled;
              over-/under-); or the
              negations are as many but crossed: each side negates a word the other says ("delivered but not
              received" / "not delivered but received"; "credit instead of a refund" / "a refund
              instead of credit"; 收到了短信但钱没到账 / 没收到短信但钱到账了; a negation closing its
              clause negates that clause: "the hot water works but the heating doesn't"), or one side
              negates a word the other says in a clause with no negation ("drains but won't spin" /
              "won't drain")
entity        a capitalised name, id, email or URL of one text is missing from the other, unless the
              other names it another way (UK/British, AWS/Amazon, K8s/Kubernetes; capitalised
              common things, GP, ATM, PIN, are no names) (in Chinese text: any Latin word, and the
              places, organisations and brands the segmenter names; an iPhone names 苹果), the
              colours differ ("the red light" / "the blue light"), both name ways to travel and
              not the same ("by train" / "by bus"), or the same words swap sides of a
              preposition ("from savings to current" vs "from current to savings"; in Chinese a
              trip's places: 从北京到上海 / 从上海到北京)
scope         they are about or for different people: adults / children, employees /
              self-employed, tenants / landlords (:data:`lexicon.AUDIENCES`), 儿童 / 成人,
              个人 / 企业, 国内 / 国外 (:data:`lexicon_zh.AUDIENCES`)
============  =====================================================================================

The guards never say yes; :func:`compare` also says how far apart the two texts' words are
(:data:`TIERS`), and the calibrated threshold of that tier decides the rest.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

from . import chinese
from . import lexicon as lx
from . import lexicon_zh as zh
from .frame import slots
from .features import EMBEDDABLE_SCRIPTS, Features, analyse, slip_equal, typo_equal

#: How much two texts' meaningful words differ: ``same`` (none, after fillers, function words
#: and typing slips), ``edit`` (at least half of them shared), ``reworded`` (the rest).
TIERS = ("same", "edit", "reworded")
#: Bumped whenever a rule or word list changes what is refused: a calibration records it.
GUARDS_VERSION = 18
#: The languages the word lists cover (lexicon.py, lexicon_zh.py). A semantic match needs both texts
#: in one of them; see :func:`unguarded`.
GUARDED_LANGUAGES = frozenset({"en", "zh"})
#: The scripts those languages are written in (CJK: Han), and letters that belong to no language
#: (full-width Latin, modifier letters). Letters of any other script make a text unguarded.
GUARDED_SCRIPTS = frozenset({"LATIN", "CJK", "FULLWIDTH", "MODIFIER"})
#: The Latin letters beyond ASCII that English borrows (café, naïve, façade, jalapeño, Zoë). Any
#: other (ı ş ğ ł ř ő å ơ ß ...) is another language's, whatever the stopwords say.
ENGLISH_ACCENTS = frozenset("áàâäéèêëíìîïóòôöúùûüçñ")
EDIT_OVERLAP = 0.5
REASONS = ("language", "slot", "number", "date", "negation", "entity", "scope")


@dataclass(frozen=True)
class Refusal:
    reason: str  # one of REASONS
    detail: str  # what differed, for logs and the calibration report


@dataclass(frozen=True)
class Comparison:
    refusal: Refusal | None
    tier: str  # one of TIERS
    overlap: float  # share of content words matched (Jaccard, typing slips forgiven)


def check(query: str, candidate: str, readable: frozenset[str] = EMBEDDABLE_SCRIPTS) -> Refusal | None:
    """Why ``candidate``'s answer must not serve ``query``, or None when no guard objects.
    ``readable``: the scripts the embedder reads (``Embedder.scripts``)."""
    return refuse(analyse(query), analyse(candidate), readable)


def compare(q: Features, c: Features, readable: frozenset[str] = EMBEDDABLE_SCRIPTS) -> Comparison:
    shared, only_q, only_c = match_content(q.content, c.content)
    union = shared + only_q + only_c
    overlap = shared / union if union else 1.0
    if only_q == only_c == 0:
        tier = "same"
    elif overlap >= EDIT_OVERLAP:
        tier = "edit"
    else:
        tier = "reworded"
    return Comparison(refuse(q, c, readable), tier, overlap)


def refuse(q: Features, c: Features, readable: frozenset[str] = EMBEDDABLE_SCRIPTS) -> Refusal | None:
    """The first guard (in :data:`REASONS` order) that objects, or None."""
    r = _language(q, c, readable)
    if r is not None:
        return r
    for guard in (_slot, _number, _date, _negation, _entity, _scope, _frame):
        r = guard(q, c)
        if r is not None:
            return r
    return None


def match_content(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[int, int, int]:
    """(shared, only in a, only in b) of two sets of content stems, a typing slip counting as
    shared."""
    sa, sb = set(a), set(b)
    left = sb - sa
    matched = len(sa & sb)
    for w in sa - sb:
        hit = next((x for x in left if typo_equal(w, x)), None)
        if hit is not None:
            left.discard(hit)
            matched += 1
    return matched, len(sa) - matched, len(sb) - matched


def content_overlap(a: tuple[str, ...], b: tuple[str, ...]) -> float:
    """Jaccard overlap of two sets of content stems, a typing slip counting as a match."""
    shared, only_a, only_b = match_content(a, b)
    union = shared + only_a + only_b
    return shared / union if union else 1.0


def _main_scripts(f: Features) -> frozenset[str]:
    """The scripts a text is written in, Latin left out when others are there (``MySQL 怎么备份``
    is Chinese with a name in it, not a mix of two languages)."""
    return (f.scripts - {"LATIN"}) or f.scripts


def unguarded(f: Features) -> str | None:
    """Why the guards cannot read a text (a script or a language outside what their word lists
    cover), or None when they can: Latin text not recognised as another language counts as
    English unless a Latin letter English does not use says otherwise (:data:`ENGLISH_ACCENTS`);
    Chinese may carry Latin words. Latin text of another language in plain ASCII, not recognised
    by its stopwords (Swedish, Indonesian), is told apart by its words: :func:`features.analyse`
    reads its language as :data:`features.OTHER_LANGUAGE`.

    Measured on 61 pairs in 18 other languages (``bench/semantic_languages.py``, "other
    languages"): without this rule the shipped matcher served 8 of their 40 traps (オン/オフ,
    загрузить/скачать, "nicht barrierefrei", Berlin and München swapped) at cosines of
    0.79-0.996; with it, none, and 1 of 21 should-hit pairs instead of 11."""
    other = f.scripts - GUARDED_SCRIPTS
    if other:
        return "+".join(sorted(other)) + " letters"
    latin = dict(f.letters_by_script).get("LATIN", "").lower()
    foreign = sorted({ch for ch in latin if not ch.isascii() and ch not in ENGLISH_ACCENTS})
    if foreign:
        return "the letters " + "".join(foreign)
    if f.language is not None and f.language not in GUARDED_LANGUAGES:
        return f"language {f.language}"
    return None


def _language(q: Features, c: Features, readable: frozenset[str]) -> Refusal | None:
    for f in (q, c):
        if (why := unguarded(f)) is not None:
            return Refusal("language", f"no guards for {why}: exact matches only")
    unread_q, unread_c = q.letters_outside(readable), c.letters_outside(readable)
    if unread_q != unread_c:
        scripts = "/".join(sorted((q.scripts | c.scripts) - readable)) or "non-Latin"
        return Refusal("language", f"{scripts} letters differ: the embedder cannot read them")
    main_q, main_c = _main_scripts(q), _main_scripts(c)
    if main_q and main_c and main_q != main_c:
        return Refusal("language", f"scripts differ: {'+'.join(sorted(main_q))} vs {'+'.join(sorted(main_c))}")
    if q.language and c.language and q.language != c.language:
        return Refusal("language", f"{q.language} vs {c.language}")
    return None


def _slot(q: Features, c: Features) -> Refusal | None:
    if q.label is not None and c.label is not None:
        if q.label == c.label and q.value != c.value:
            return Refusal("slot", f"{q.label}: {q.value!r} vs {c.value!r}")
        if q.label != c.label and q.value == c.value:
            return Refusal("slot", f"{q.label!r} vs {c.label!r} for the same value")
    if q.quoted and c.quoted and q.quoted != c.quoted:
        return Refusal("slot", f"quoted {list(q.quoted)} vs {list(c.quoted)}")
    for name, members in _SLOT_CLASSES:
        if differ := _closed_class(q, c, members, each_side=name == "payment"):  # "cash" may be what is paid out
            return Refusal("slot", f"{name} {differ}")
    return None


def _firm(numbers: tuple[str, ...], other: tuple[str, ...]) -> tuple[str, ...]:
    """``numbers`` with each Chinese lone "one X" (``chinese.WEAK_ONE``) read as 1 when the other
    text has a number, and dropped when it has none (重新办一张 asks what 重新办 asks)."""
    if chinese.WEAK_ONE not in numbers:
        return numbers
    if not [n for n in other if n != chinese.WEAK_ONE]:
        return tuple(n for n in numbers if n != chinese.WEAK_ONE)
    return tuple(sorted("1" if n == chinese.WEAK_ONE else n for n in numbers))


def _number(q: Features, c: Features) -> Refusal | None:
    qn, cn = _firm(q.numbers, c.numbers), _firm(c.numbers, q.numbers)
    if qn != cn:
        a, b = Counter(qn), Counter(cn)
        return Refusal("number", f"{sorted((a - b).elements())} vs {sorted((b - a).elements())}")
    differ = _closed_class(q, c, _UNITS)
    return Refusal("number", f"units {differ}") if differ else None


def _named_members(f: Features, members: dict[str, int]) -> dict[str, int]:
    """The members of a closed class ``f`` names: as words, and (Chinese ones, which a segmenter
    may cut differently) anywhere in its text."""
    found = {w: members[w] for w in f.words if w in members}
    if f.language == "zh":
        found.update((w, i) for w, i in members.items() if not w.isascii() and w in f.text)
    return found


def _closed_class(q: Features, c: Features, members: dict[str, int], each_side: bool = False) -> str | None:
    """The members of a closed class (:data:`lexicon.UNITS`, :data:`lexicon.TRANSPORT`, ...) each
    text names, when both name some and not the same ones; else None. ``each_side``: only when
    each names one the other does not (a question may name several spans of time: "days of
    leave after 5 years" asks what "leave after five years" asks)."""
    named_q, named_c = _named_members(q, members), _named_members(c, members)
    mine, theirs = set(named_q.values()), set(named_c.values())
    if mine and theirs and mine != theirs and (not each_side or (mine - theirs and theirs - mine)):
        names = [sorted(w for w, i in named.items() if i in s) for named, s in ((named_q, mine - theirs),
                                                                              (named_c, theirs - mine))]
        return f"{names[0]} vs {names[1]}"
    return None


def _members(*classes: tuple[str, ...]) -> dict[str, int]:
    """Word -> member index of one closed class, from lists of members' space-separated names."""
    return {w: i for i, names in enumerate(m for cls in classes for m in cls) for w in names.split()}


_EN_ALIASES = {lx.stem(name): group for group in lx.ALIASES for name in group}
_UNITS = _members(lx.UNITS)
_TIME_UNITS = _members(lx.TIME_UNITS)
_TRANSPORT = _members(lx.TRANSPORT)
#: Closed classes that fill a template's slot (the slot guard): sizes, diets, seats, beds, delivery
#: speeds, cooking appliances; in Chinese text colours, languages, spice levels, appliances.
_SLOT_CLASSES = (("size", _members(lx.SIZES)), ("diet", _members(lx.DIETS)), ("seat", _members(lx.SEATS)),
                 ("bed", _members(lx.BEDS)), ("delivery", _members(lx.DELIVERY)),
                 ("gearbox", _members(lx.GEARBOXES)), ("payment", _members(lx.PAYMENTS)), ("payment", _members(zh.PAYMENTS)),
                 ("room", _members(zh.ROOMS)),
                 ("appliance", _members(lx.APPLIANCES)), ("colour", _members(zh.COLOURS)),
                 ("language", _members(zh.LANGUAGES)), ("spice", _members(zh.SPICE)),
                 ("appliance", _members(zh.APPLIANCES)))


def _date(q: Features, c: Features) -> Refusal | None:
    only_q, only_c = set(q.dates - c.dates), set(c.dates - q.dates)
    for marker, inside in lx.HALF_DAYS.items():  # "7pm" agrees with "this evening"
        for mine, theirs in ((only_q, only_c), (only_c, only_q)):
            if marker in mine and theirs & inside:
                mine.discard(marker)
                theirs -= inside
    if only_q or only_c:
        return Refusal("date", f"{sorted(only_q)} vs {sorted(only_c)}")
    if q.frequencies and c.frequencies and q.frequencies != c.frequencies:
        return Refusal("date", f"{sorted(q.frequencies)} vs {sorted(c.frequencies)}")
    differ = _closed_class(q, c, _TIME_UNITS, each_side=True)  # "after 2 weeks" / "after 2 months"
    if differ:
        return Refusal("date", f"spans {differ}")
    if q.spans - c.spans and c.spans - q.spans:  # 第三天 / 第三个月
        return Refusal("date", f"spans {sorted(q.spans - c.spans)} vs {sorted(c.spans - q.spans)}")
    return None


@lru_cache(maxsize=1)
def _antonym_stems() -> tuple[tuple[frozenset[str], frozenset[str]], ...]:
    return tuple((frozenset(map(lx.stem, left.split())), frozenset(map(lx.stem, right.split())))
                 for left, right in lx.ANTONYMS)


def _negation(q: Features, c: Features) -> Refusal | None:
    if q.negations != c.negations:
        return Refusal("negation", f"negation cues {list(q.negation_cues)} vs {list(c.negation_cues)}")
    if crossed := _crossed(q, c):
        return Refusal("negation", crossed)
    if q.language == "zh" and c.language == "zh":
        pair = (chinese.antonym_refusal(q.words, q.text, c.words, c.text) or chinese.char_antonym_refusal(q.text, c.text)
                or chinese.undo_refusal(q.text, c.text))
        if pair is not None:
            return Refusal("negation", f"antonyms {pair}")
    only_q, only_c = q.stems - c.stems, c.stems - q.stems
    # A negated form on one side only, its stem on the other (even when that side says the stem
    # too: "lock the door with the smart lock app" / "unlock the door with the smart lock app").
    for mine, other in ((only_q, c.stems), (only_c, q.stems)):
        for w in mine:
            for p in lx.NEGATING_PREFIXES:
                if w.startswith(p) and len(w) - len(p) >= 3 and w[len(p):] in other:
                    return Refusal("negation", f"{w[len(p):]} vs {w}")
    # A particle said more often on one side counts as said there only: "turn on away mode on my
    # thermostat" / "turn off away mode on my thermostat" both say "on".
    more_q, more_c = _more_often(q, c)
    only_q, only_c = only_q | more_q, only_c | more_c
    if not only_q or not only_c:
        return None
    for left, right in _antonym_stems():
        for (mine, my_neg), (theirs, their_neg) in (((only_q, q.negated), (only_c, c.negated)),
                                                    ((only_c, c.negated), (only_q, q.negated))):
            a, b = mine & left, theirs & right
            # One of the two negated says what the other says: "broken" / "isn't working".
            if a and b and bool(a & my_neg) == bool(b & their_neg):
                return Refusal("negation", f"antonyms {min(a)}/{min(b)}")
    for one, two in lx.OPPOSITE_PREFIXES:  # overweight / underweight
        for mine, theirs in ((only_q, only_c), (only_c, only_q)):
            for w in mine:
                if w.startswith(one) and len(w) - len(one) >= 3 and two + w[len(one):] in theirs:
                    return Refusal("negation", f"{w} vs {two + w[len(one):]}")
    return None


def _more_often(q: Features, c: Features) -> tuple[set[str], set[str]]:
    """The light prepositions (on, off, in, out, up, down, ...) both sides read as words
    (``Features.stems``: "in advance" says no "in") and each says more often than the other; one
    said on one side only is in that side's stems alone already."""
    more_q, more_c = set(), set()
    for w in q.stems & c.stems & lx.LIGHT_PREPOSITIONS:
        nq, nc = q.sequence.count(w), c.sequence.count(w)
        if nq > nc:
            more_q.add(w)
        elif nc > nq:
            more_c.add(w)
    return more_q, more_c


def _crossed(q: Features, c: Features) -> str | None:
    """As many negations on both sides, but crossed: a word each side negates is said, and not
    negated, on the other ("delivered but I haven't received it" / "not delivered but I've
    received it"; "store credit instead of a refund" / "a refund instead of store credit";
    收到了短信但是钱没到账 / 没收到短信但是钱已经到账了). Both ways, not one: "Why hasn't my
    refund arrived?" / "My refund hasn't arrived" negate different words (the scope is a guess: the
    word after the cue) but cross one way only. One way is enough only where the other side says
    the word in a clause with no negation at all (English: ``Features.affirmed``)."""
    def said(f: Features, words: frozenset[str]) -> frozenset[str]:
        if f.language == "zh":
            return frozenset(w for w in words if not w.isascii() and chinese.affirms(f.text, (w,)))
        return words & f.stems
    one = said(c, q.negated - c.negated)
    other = said(q, c.negated - q.negated)
    if one and other:
        return f"negations crossed: not {min(one)} / not {min(other)}"
    # One way is enough where the other side says the word in a clause of its own with no
    # negation: "the washer drains but won't spin" / "the washer won't drain".
    if affirmed := (q.negated - c.negated) & c.affirmed or (c.negated - q.negated) & q.affirmed:
        return f"negations crossed: not {min(affirmed)} / {min(affirmed)}"
    return None


def _named(entity: str, f: Features) -> bool:
    """Whether ``f`` names ``entity``: as a word, or (a Chinese name, which a segmenter may cut
    differently on each side) anywhere in its text; in Chinese text also by another name of the
    same product (iPhone / 苹果手机, k8s / Kubernetes: ``lexicon_zh.ALIASES``)."""
    if entity in f.words or (not entity.isascii() and entity in f.text):
        return True
    squeezed = f.text.lower().replace(" ", "")  # "HTTP 404" names "http404"
    if any(ch.isdigit() for ch in entity) and entity in squeezed:
        return True
    if f.language != "zh":
        return any(name in f.words for name in _EN_ALIASES.get(entity, ()))
    return (any(name.replace(" ", "") in squeezed for name in chinese.aliases(entity))
            or any(product in squeezed for product in zh.BRAND_PRODUCTS.get(entity, ())))


def _entity(q: Features, c: Features) -> Refusal | None:
    missing_q = sorted(e for e in q.entities if not _named(e, c))
    missing_c = sorted(e for e in c.entities if not _named(e, q))
    if missing_q or missing_c:
        return Refusal("entity", f"{missing_q} vs {missing_c}")
    colours_q, colours_c = q.words & lx.COLOURS, c.words & lx.COLOURS
    if colours_q != colours_c:
        return Refusal("entity", f"colour {sorted(colours_q)} vs {sorted(colours_c)}")
    if differ := _closed_class(q, c, _TRANSPORT):
        return Refusal("entity", f"travel {differ}")
    if q.language == "zh" and c.language == "zh":
        trip_q, trip_c = chinese.route(q.text), chinese.route(c.text)
        if trip_q and trip_c and trip_q == trip_c[::-1]:
            return Refusal("entity", f"swapped: {'→'.join(trip_q)} vs {'→'.join(trip_c)}")
    content_q, content_c = set(q.content), set(c.content)
    for prep, x in q.prep_objects - c.prep_objects:
        for prep2, y in c.prep_objects - q.prep_objects:
            if prep == prep2 and x != y and x in content_c and y in content_q:
                return Refusal("entity", f"swapped: '{prep} {x}' vs '{prep} {y}'")
    return None


def _scope(q: Features, c: Features) -> Refusal | None:
    """Refuse when one text names an audience the other does not (a typing slip of the same
    word, "chlid", does not count)."""
    def unmatched(mine: Features, other: Features) -> list[str]:
        return sorted(word for group, word in mine.audiences.items() if group not in other.audiences
                      and not any(typo_equal(word, w) for w in other.words))

    only_q, only_c = unmatched(q, c), unmatched(c, q)
    if only_q or only_c:
        return Refusal("scope", f"for {only_q} vs {only_c}")
    return None


def _frame(q: Features, c: Features) -> Refusal | None:
    """Chinese questions in one frame with another noun in it (:func:`chinese.frame_refusal`);
    English ones with another word in it (:func:`_english_frame`)."""
    if q.language == "zh" and c.language == "zh":
        differ = chinese.frame_refusal(q.text, q.nouns, c.text, c.nouns)
        if differ is not None:
            return Refusal("slot", f"another noun in the same question: {differ}")
    elif q.language != "zh" and c.language != "zh":
        differ = _english_frame(q, c)
        if differ is not None:
            return Refusal("slot", f"another word in the same question: {differ}")
    return None


def _english_frame(q: Features, c: Features) -> str | None:
    """Two questions that are one frame, the same words before and after a slot of at most
    :data:`FRAME_SLOT` words a side (:data:`FRAME_SHARE` of the longer text at least), whose slots
    each hold a content word the other text lacks: "does the gym have a sauna" / "... a swimming
    pool". Words of one meaning (:data:`lexicon.SYNONYMS`, aliases), the words of asking ("how" /
    "what's the best way") and typing slips do not count."""
    a, b = q.sequence, c.sequence
    shared, mid_a, mid_b = slots(a, b)
    if not mid_a or not mid_b or len(mid_a) > FRAME_SLOT or len(mid_b) > FRAME_SLOT:
        return None
    if shared < max(3, FRAME_SHARE * max(len(a), len(b))):
        return None
    content_a, content_b = set(q.content), set(c.content)

    def alone(w: str, content: set[str], other: set[str], other_mid: tuple[str, ...]) -> bool:
        return ((w in content or w in _SLOT_PREPOSITIONS) and w not in other and w not in _ASKING
                and not any(slip_equal(w, x) or _SYNONYM.get(w, -1) == _SYNONYM.get(x, -2) for x in other_mid))

    only_a = [w for w in mid_a if alone(w, content_a, content_b, mid_b)]
    only_b = [w for w in mid_b if alone(w, content_b, content_a, mid_a)]
    if (only_a and only_b) or set(only_a + only_b) & _TIME_RELATIONS:
        return f"{' '.join(only_a) or ' '.join(mid_a)} vs {' '.join(only_b) or ' '.join(mid_b)}"
    return None


#: A frame's slot is at most this many words a side; the rest of the question, this share of the
#: longer one's words at least.
FRAME_SLOT = 3
FRAME_SHARE = 0.5
#: The frame rule compares stems.
_ASKING = frozenset(map(lx.stem, lx.ASKING_WORDS))
_SLOT_PREPOSITIONS = frozenset(map(lx.stem, lx.SLOT_PREPOSITIONS))
_TIME_RELATIONS = frozenset(map(lx.stem, lx.TIME_RELATIONS))
_SYNONYM = {lx.stem(w): i for i, group in enumerate(lx.SYNONYMS + tuple(" ".join(g) for g in lx.ALIASES))
            for w in group.split()}

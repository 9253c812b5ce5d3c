"""What the guards compare, read once per text: words, numbers, dates, named entities,
negation cues, script and language, template slots.

:func:`analyse` is pure and deterministic (regexes and the word lists of
:mod:`kvcached_router.semantic.lexicon`); the matcher runs it once per stored entry and once
per query, so guards over k candidates cost k set comparisons.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

from kvcached_client.text import normalize

from . import chinese
from . import lexicon as lx
from .embed import MINILM_SCRIPTS, minilm_vocabulary

#: Scripts whose words the English embedder (MiniLM) reads (possibly badly); other letters it
#: maps to [UNK] or to unrelated pieces, so with it texts in them are compared letter by letter.
#: A multilingual embedder declares its own (``Embedder.scripts``).
EMBEDDABLE_SCRIPTS = MINILM_SCRIPTS
#: The language of plain Latin text that no stopword list names and that does not read as
#: English (:func:`_reads_as_english`): Swedish, Indonesian, ... The guards have no word lists for it.
OTHER_LANGUAGE = "other"
#: Share of a text's words that must be English ones (:func:`_reads_as_english`).
ENGLISH_WORD_SHARE = 0.6
#: Offset of the Chinese audience groups (lexicon_zh.AUDIENCES) in ``Features.audiences``.
ZH_AUDIENCE = 1000

#: Emails, URLs, @handles and #tags: entities. "#12345" is a number (an order's), as "# 12345" is.
_CONTACT = re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+|https?://\S+|www\.\S+|(?<!\w)@\w+|(?<!\w)#(?!\d+\b)\w+")
#: "No. 42", "no.42", "Nr. 7", "№ 5": a number's abbreviation, read as "#42" (not the negation "no").
_NUMERO = re.compile(r"\b(?:[Nn][Oo]|[Nn]r)\.\s*(?=\d)|№\s*(?=\d)")
#: Two short pieces joined by a hyphen are one word: "Wi-Fi" is "WiFi" (a name, as "wifi" is).
_SHORT_HYPHEN = re.compile(r"(?<![A-Za-z])([A-Za-z]{1,2})-([A-Za-z]{1,2})(?![A-Za-z])")
_TITLE_BEFORE = re.compile(r"(?<!\w)(?:Dr|Mr|Mrs|Ms|Mx|Prof|St|Sr|Jr)\.$")
_QUOTED = re.compile(r'"([^"]+)"|`([^`]+)`|(?<!\w)\'([^\']+)\'(?!\w)')
_LABEL = re.compile(r"^([^:\n]{1,80}?)(?<!\d):(?!\d)\s*(.+)$", re.S)
_TOKEN = re.compile(r"[£$€¥]?\w+(?:['.,:/]\w+)*")
_NUMBER = re.compile(r"[£$€¥]?\d+(?:[.,:/]\d+)*")
_NUMBER_UNIT = re.compile(r"([£$€¥]?\d+(?:[.,]\d+)*)([a-z]+)")
_N_T = {"ca": "can", "wo": "will", "sha": "shall", "ai": "is"}
_CLITICS = frozenset({"s", "re", "ve", "ll", "d", "m"})
_LONG_DATE_WORDS = tuple(sorted(w for w in lx.DATE_WORDS if len(w) >= 6))
_AUDIENCE_GROUP = {w: g for g, words in enumerate(lx.AUDIENCES) for w in words.split()}
_PREPOSITIONS = frozenset({"from", "to", "into", "onto", "than", "versus", "vs", "between"})


@dataclass(frozen=True)
class Features:
    """One text as the guards see it (all words lower case, stemmed where it says so)."""

    text: str  # the normalised text
    words: frozenset[str]  # every word token and its stem
    stems: frozenset[str]  # stems of every word token (numbers excluded)
    content: tuple[str, ...]  # stems of the words that carry meaning, in order
    negations: int  # negation cues ("not", "never", "without", ...; "n't" counts)
    negation_cues: tuple[str, ...]
    numbers: tuple[str, ...]  # canonical values, sorted ("2", "50000", "£50", "9:15")
    dates: frozenset[str]  # weekdays, months, "tomorrow", "next week", "pm", ...
    entities: frozenset[str]  # capitalised names, ids, emails, URLs (lower case)
    audiences: dict[int, str]  # lexicon.AUDIENCES group -> the word that named it ("children")
    prep_objects: frozenset[tuple[str, str]]  # ("from", "savings"): who is on which side
    scripts: frozenset[str]  # Unicode scripts of the letters (LATIN, CJK, HANGUL, ...)
    foreign_letters: str  # the letters outside EMBEDDABLE_SCRIPTS, in order
    language: str | None  # "zh" for Chinese; "en", "es", ... when the stopwords say so clearly
    label: str | None  # "label" of a "label: value" text
    value: str | None
    quoted: tuple[str, ...]  # quoted or back-ticked spans
    letters_by_script: tuple[tuple[str, str], ...] = ()  # (script, its letters in order), every script
    frequencies: frozenset[str] = frozenset()  # "daily", "monthly", ...: how often, not when
    #: What the negation cues negate: in English the stem of the content word after each cue
    #: ("haven't received" -> "receiv"), in Chinese the two characters after each negation
    #: character (没到账 -> 到账). A rough scope, read only by the negation guard's crossing rule.
    negated: frozenset[str] = frozenset()
    #: English: the content stems of clauses with no negation cue ("the washer drains but won't
    #: spin": drain), read by the crossing rule: what one side negates, the other affirms.
    affirmed: frozenset[str] = frozenset()
    nouns: frozenset[str] = frozenset()  # in Chinese text, the words the segmenter tags as nouns
    spans: frozenset[str] = frozenset()  # in Chinese text, units of spans of time after a number ("day")
    sequence: tuple[str, ...] = ()  # the stems of every word, in order (the frame rule's)

    def letters_outside(self, readable: frozenset[str]) -> str:
        """The letters of the scripts an embedder reading ``readable`` cannot read, in order."""
        return "".join(letters for script, letters in self.letters_by_script if script not in readable)


#: The language groups that get thresholds of their own: Chinese, Chinese with Latin words in it
#: (names, code, units), and every other text (English, mostly).
LANGUAGE_GROUPS = ("zh", "mixed", "en")


def language_group(f: Features) -> str:
    """Which of :data:`LANGUAGE_GROUPS` a text's thresholds come from."""
    if f.language == "zh":
        return "mixed" if "LATIN" in f.scripts else "zh"
    return "en"


def _fold(text: str) -> str:
    return " ".join(re.findall(r"\w+", text.casefold()))


def _script(ch: str) -> str:
    name = unicodedata.name(ch, "")
    first = name.split(" ", 1)[0]
    return "CJK" if first in ("CJK", "IDEOGRAPHIC") else (first or "UNKNOWN")


def _scripts(text: str) -> tuple[frozenset[str], str, tuple[tuple[str, str], ...]]:
    by_script: dict[str, list[str]] = {}
    foreign = []
    for ch in text:
        if unicodedata.category(ch).startswith("L"):
            s = _script(ch)
            by_script.setdefault(s, []).append(ch)
            if s not in EMBEDDABLE_SCRIPTS:
                foreign.append(ch)
    letters = tuple(sorted((s, "".join(chs)) for s, chs in by_script.items()))
    return frozenset(by_script), "".join(foreign), letters


def _language(lower_tokens: list[str], text: str) -> str | None:
    scores = {lang: sum(t in words for t in lower_tokens) for lang, words in lx.LANGUAGE_STOPWORDS.items()}
    for ch in text.lower():
        lang = lx.LANGUAGE_LETTERS.get(ch)
        if lang:
            scores[lang] += 1
    ranked = sorted(scores.items(), key=lambda kv: kv[1], reverse=True)
    (best, top), (_, second) = ranked[0], ranked[1]
    return best if top >= 2 and top > second else None


def _reads_as_english(text: str) -> bool:
    """Whether plain Latin text of unknown language can be English: it is under three words, or
    has an English stopword, or :data:`ENGLISH_WORD_SHARE` of its words are whole words of MiniLM's
    vocabulary. Measured on every English text of the project's sets (about 2,900): one falls
    under the share ("Can diabetics eat watermelon?", 0.5), and it has "can"; Swedish, Polish,
    Czech, Indonesian, Romanian and French questions not recognised by their stopwords fall
    under it (0.0-0.57) with no English stopword."""
    words = re.findall(r"[a-z]+", text.lower())
    if len(words) < 3 or any(w in lx.LANGUAGE_STOPWORDS["en"] for w in words):
        return True
    vocabulary = minilm_vocabulary()
    return not vocabulary or sum(w in vocabulary for w in words) >= ENGLISH_WORD_SHARE * len(words)


def _number_value(digits: str) -> str:
    currency = digits[0] if digits[0] in "£$€¥" else ""
    body = digits[len(currency):]
    if ":" in body or "/" in body:
        return currency + body
    body = body.replace(",", "")
    try:
        v = float(body)
    except ValueError:
        return currency + body
    return currency + (str(int(v)) if v.is_integer() else repr(v))


def _expand(token: str) -> list[str]:
    """``don't`` -> do not, ``can't`` and ``cant`` -> can not, ``Mary's`` -> Mary."""
    low = token.lower()
    if low in lx.BARE_NEGATIVES:
        return [lx.BARE_NEGATIVES[low], "not"]
    if low.endswith("n't"):
        head = token[:-3]
        return [_N_T.get(head.lower(), head), "not"]
    if low == "cannot":
        return [token[:3], "not"]
    if "'" in token:
        head, tail = token.split("'", 1)
        if tail.lower() in _CLITICS:
            return [head] if head else []
    return [token]


def _damerau1(a: str, b: str) -> bool:
    """True when ``a`` and ``b`` differ by at most one edit or one swap of neighbours."""
    if a == b:
        return True
    la, lb = len(a), len(b)
    if abs(la - lb) > 1:
        return False
    i = 0
    while i < min(la, lb) and a[i] == b[i]:
        i += 1
    if la == lb:
        if a[i + 1:] == b[i + 1:]:
            return True
        return i + 1 < la and a[i] == b[i + 1] and a[i + 1] == b[i] and a[i + 2:] == b[i + 2:]
    return a[i + 1:] == b[i:] if la > lb else a[i:] == b[i + 1:]


def _starts_sentence(body: str, start: int) -> bool:
    j = start - 1
    while j >= 0 and body[j].isspace():
        j -= 1
    if j >= 0 and body[j] == "." and _TITLE_BEFORE.search(body, 0, j + 1):
        return False  # "Dr. Patel": a title's full stop
    return j < 0 or body[j] in '.!?:;"('


def _date_word(low: str, stemmed: str) -> str | None:
    """The DATE_WORDS entry ``low`` is, plural, inflected or misspelt ("weekends", "evenings",
    "Mondys"), or None."""
    for form in (low, low[:-1] if low.endswith("s") else "", stemmed):
        if form in lx.DATE_ALIASES:
            return lx.DATE_ALIASES[form]
        if form in lx.DATE_WORDS:
            return form
    return _misspelt_date(low)


def _misspelt_date(low: str) -> str | None:
    """The long date word ("Mondys", "evenigns", "Febuary") a typing slip away from ``low``."""
    if len(low) < 6:
        return None
    base = low[:-1] if low.endswith("s") else low
    return next((d for d in _LONG_DATE_WORDS if _damerau1(base, d) or _damerau1(low, d)), None)


def analyse(text: str) -> Features:
    """Read ``text`` (normalised first with :func:`kvcached_client.text.normalize`).

    A text with Chinese in it is split at script boundaries: the Han runs are read by
    :mod:`chinese` (words, negation cues, numerals, dates, names, audiences), the rest by the
    English reader below, and both go into one :class:`Features`. Latin words inside Chinese
    text are names, product ids or code (``MySQL``, ``iPhone``, ``list``): entities."""
    t = normalize(text)
    scripts, foreign, letters = _scripts(t)
    m = _LABEL.match(t)
    label, value = (_fold(m.group(1)), _fold(m.group(2))) if m else (None, None)
    quoted = tuple(_fold(next(g for g in q.groups() if g is not None)) for q in _QUOTED.finditer(t))
    han = chinese.has_han(t)

    reader = _Reader()
    body = _SHORT_HYPHEN.sub(r"\1\2", _NUMERO.sub("#", t))
    body = _SET_PHRASE.sub(lambda m: lx.SET_PHRASES[m.group().lower()], body)  # "out of order": not working
    reader.entities.update(c.lower() for c in _CONTACT.findall(body))
    body = _CONTACT.sub(" ", body)
    if han:
        body = chinese.HAN_RUN.sub(" . ", body)  # a boundary: no Latin word is glued to a Chinese one
    raw: list[tuple[str, bool]] = []  # (token, starts a sentence)
    for mt in _TOKEN.finditer(body):
        initial = _starts_sentence(body, mt.start())
        raw.extend((piece, initial and k == 0) for k, piece in enumerate(_expand(mt.group())))
    raw = _with_no(raw)
    # In Title Case or ALL CAPS text a capital says nothing: that shows on the small words.
    reader.case_informative = not any(tok[:1].isupper() and not initial and tok.lower() in lx.FUNCTION_WORDS
                                      and tok != "I" for tok, initial in raw)
    for i, (tok, initial) in enumerate(raw):
        reader.feed(tok, initial, raw[i + 1][0].lower() if i + 1 < len(raw) else "")
    reader.flush_number_words()
    reader.end_clause()
    r = reader
    audiences = _audiences(r.lower_tokens)
    language = _language(r.lower_tokens, t)
    if language is None and scripts <= {"LATIN"} and not _reads_as_english(t):
        language = OTHER_LANGUAGE
    frequencies = r.dates & lx.FREQUENCY_WORDS
    r.dates -= frequencies
    if han:
        zh = chinese.read(t)
        # Names, not ordinary words: a capital or a digit (MySQL, iPhone, k8s); "log", "commit"
        # are often the Chinese side's 日志, 提交 in the other text.
        latin_names = {tok.lower() for tok, _ in raw if len(tok) >= 2 and tok.isascii() and tok.isalnum()
                       and not tok.isdigit() and (any(ch.isupper() for ch in tok) or any(ch.isdigit() for ch in tok))
                       and tok.lower() not in lx.FUNCTION_WORDS and tok.lower() not in lx.NUMBER_UNITS
                       and tok.lower() not in chinese.GENERIC_LATIN}
        r.entities.update(latin_names | zh.entities)
        r.words.update(zh.words)
        r.stems.update(zh.words)
        r.content.extend(zh.content)
        r.cues.extend(zh.cues)
        r.negated.update(zh.negated)
        r.numbers.extend(zh.numbers)
        r.dates.update(zh.dates)
        frequencies |= zh.frequencies
        audiences.update({ZH_AUDIENCE + g: w for g, w in zh.audiences.items()})
        language = "ja" if scripts & {"HIRAGANA", "KATAKANA"} else "zh"
    return Features(
        text=t, words=frozenset(r.words), stems=frozenset(r.stems), content=tuple(r.content),
        negations=len(r.cues), negation_cues=tuple(r.cues), numbers=tuple(sorted(r.numbers)),
        dates=frozenset(r.dates), entities=frozenset(r.entities), audiences=audiences,
        prep_objects=frozenset(r.prep_objects),
        scripts=scripts, foreign_letters=foreign, language=language,
        label=label, value=value, quoted=quoted, letters_by_script=letters, frequencies=frozenset(frequencies),
        negated=frozenset(r.negated), affirmed=frozenset() if han else frozenset(r.affirmed),
        nouns=frozenset(zh.nouns) if han else frozenset(),
        spans=frozenset(zh.spans) if han else frozenset(), sequence=tuple(lx.stem(w) for w in r.lower_tokens))


class _Reader:
    """Walks the tokens of one text left to right and sorts each into what the guards compare."""

    def __init__(self) -> None:
        self.case_informative = True
        self.words: set[str] = set()
        self.stems: set[str] = set()
        self.content: list[str] = []
        self.cues: list[str] = []
        self.numbers: list[str] = []
        self.dates: set[str] = set()
        self.entities: set[str] = set()
        self.prep_objects: set[tuple[str, str]] = set()
        self.lower_tokens: list[str] = []
        self._number_words: list[str] = []
        self._prev_was_number = False
        self._open_prep: str | None = None
        self._leading = True  # still in the greetings and hesitations a text may open with
        self.negated: set[str] = set()  # the content word right after each negation cue (stems)
        self._negate_next = 0  # how many of the next content words a negation cue reaches
        self._clause: list[str] = []  # the content stems of the clause being read, up to its last cue
        self._stopper: str | None = None  # "stop", "prevent", "keep" read in this clause: "from X-ing" negates X
        self.affirmed: set[str] = set()  # the content stems of clauses with no negation cue
        self._clause_words: list[str] = []  # every content stem of the clause being read
        self._clause_cued = False  # whether a negation cue was read in it

    def end_clause(self) -> None:
        """A clause ends (a conjunction, or the text's end). A cue that reached no content word
        closed its clause ("... but the central heating isn't"): it negates what that clause said
        before it."""
        if self._negate_next:
            self.negated.update(self._clause)
        if not self._clause_cued:
            self.affirmed.update(self._clause_words)
        self._negate_next = 0
        self._clause = []
        self._clause_words = []
        self._clause_cued = False
        self._stopper = None

    def flush_number_words(self) -> None:
        if self._number_words:
            self.numbers.append(_number_value(str(_parse_number_words(self._number_words))))
            self._number_words.clear()
            self._prev_was_number = True

    def feed(self, tok: str, initial: bool, next_low: str) -> None:
        low = tok.lower()
        self.lower_tokens.append(low)
        if low in _STOPPERS:
            self._stopper = low
        if low in lx.NUMBER_WORDS or low in lx.NUMBER_SCALES:
            self._number_words.append(low)
            return
        self.flush_number_words()
        was_number, self._prev_was_number = self._prev_was_number, False
        if self._number(tok, low):
            self._prev_was_number = True
            self._leading = False
            return
        if was_number and low in lx.CURRENCY_WORDS:
            if self.numbers[-1][:1].isdigit():
                self.numbers[-1] = lx.CURRENCY_WORDS[low] + self.numbers[-1]
            return
        if was_number and low in ("am", "pm"):
            self.dates.add(low)
            return
        self._word(tok, low, initial, next_low)

    def _number(self, tok: str, low: str) -> bool:
        if _NUMBER.fullmatch(tok):
            self.numbers.append(_number_value(tok))
            return True
        mu = _NUMBER_UNIT.fullmatch(low)
        if mu and mu.group(2) in lx.NUMBER_UNITS:
            self.numbers.append(_number_value(mu.group(1)))
            if mu.group(2) in ("am", "pm"):
                self.dates.add(mu.group(2))
            return True
        if any(ch.isdigit() for ch in tok):  # an id: "A123", "B12", "HTTP404": its numbers count too
            self.entities.add(low)
            if low not in lx.DIGIT_NAMES:  # "K8s", "S3": a name, not a value
                self.numbers.extend(_number_value(d) for d in re.findall(r"\d+", tok))
            self.content.append(low)
            self.words.add(low)
            self._leading = False
        return False

    def _inverted(self) -> bool:
        """Whether the "not" just read follows an auxiliary that opens a question ("Why won't my
        phone charge?", "Isn't the pool open?"): then what it negates is the verb after the subject,
        so the cue reaches two content words, not one."""
        t = self.lower_tokens
        return (len(t) >= 2 and t[-1] == "not" and t[-2] in _AUXILIARIES
                and (len(t) == 2 or t[-3] in _WH or t[-3] in lx.FILLERS))

    def _too_to(self) -> bool:
        """Whether the "to" just read closes "too <word> to" ("too big to fit": it will not fit)."""
        t = self.lower_tokens
        return len(t) >= 3 and t[-3] == "too"

    def _word(self, tok: str, low: str, initial: bool, next_low: str) -> None:
        if any(ch.isdigit() for ch in tok):
            return  # an id, already taken
        s = lx.stem(low)
        if not (low == "in" and next_low in _IN_IDIOMS):  # "in advance" says no direction (in / out)
            self.words.update((low, s))
            self.stems.add(s)
        if low in _PARTICLES and (verb := _phrasal(self.lower_tokens, low, next_low)) is not None:
            self.words.add(verb)  # "take the money out of": remove
            self.stems.add(lx.stem(verb))
        if self._leading and (low in lx.FILLERS or low in lx.LEADING_GREETINGS):
            return
        self._leading = False
        date = _date_word(low, s)
        if date in ("may", "march") and not (tok[:1].isupper() and not initial):
            date = None  # the verbs
        if (tok[:1].isupper() and not initial and self.case_informative and not date and low != "i"
                and low not in lx.FUNCTION_WORDS and low not in lx.FILLERS and low not in lx.COMMON_ABBREVIATIONS):
            self.entities.add(s)
        if date:
            self.dates.add(date)
        elif low in lx.DATE_RELATIVE and lx.stem(next_low) in lx.DATE_UNITS:
            self.dates.add(f"{low} {lx.stem(next_low)}")
        elif low in _WHICH_WEEK and next_low in lx.WEEKDAYS:  # "next Monday" is not this one
            self.dates.add(f"{low} {next_low}")
        elif low in _CLAUSE_BREAKS:
            self.end_clause()
        elif low in lx.NEGATION_CUES or (low in lx.STOP_WORDS and next_low.endswith("ing") and len(next_low) > 4):
            self.cues.append(low)  # "stop watering" negates watering; "stop my plan renewing" is an action
            self._clause_cued = True
            self._negate_next = 0 if low in lx.SELF_NEGATING else 2 if self._inverted() else 1
            if low in lx.SELF_NEGATING and next_low in _ENDS_NEGATED_SUBJECT:
                self.negated.update(self._clause)  # "the gas bottle was missing (from ...)": not the bottle
        elif (low == "other" and next_low == "than") or (low == "to" and self._too_to()):
            self.cues.append(low)  # "plans other than Enterprise": not Enterprise; "too big to fit": not fit
            self._clause_cued = True
            self._negate_next = 1
        elif low == "from" and self._stopper and next_low.endswith("ing") and len(next_low) > 4:
            self.cues.append(f"{self._stopper} from")  # "stop my screen from locking": not locking
            self._clause_cued = True
            self._stopper = None
            self._negate_next = 1
        elif low in _PREPOSITIONS:
            self._open_prep = low
        elif low in lx.LIGHT_PREPOSITIONS and self._negate_next:  # "shifts up but not down": not down
            self.negated.add(s)  # and the reach goes on: "not on my laptop" negates the laptop too
            self._clause_words.append(s)
        elif low not in lx.FUNCTION_WORDS and low not in lx.FILLERS and low not in lx.LIGHT_PREPOSITIONS:
            self.content.append(s)
            self._clause_words.append(s)
            if self._negate_next:
                self.negated.add(s)
                self._negate_next -= 1
            else:
                self._clause.append(s)
            if self._open_prep is not None:
                self.prep_objects.add((self._open_prep, s))
                self._open_prep = None


_SET_PHRASE = re.compile(r"(?<![\w-])(?:" + "|".join(map(re.escape, lx.SET_PHRASES)) + r")(?![\w-])", re.IGNORECASE)
_PHRASAL = {(lx.stem(verb), particle): (meaning, after) for verb, particle, meaning, after in lx.PHRASAL_VERBS}
_PARTICLES = frozenset(particle for _, particle in _PHRASAL)


def _phrasal(tokens: list[str], particle: str, next_low: str) -> str | None:
    """The verb a particle (the last of ``tokens``) makes with a verb up to four words before it,
    :data:`lexicon.PHRASAL_VERBS` ("take the money out of": remove), or None."""
    for back in tokens[-5:-1]:
        hit = _PHRASAL.get((lx.stem(back), particle))
        if hit is not None and (not hit[1] or next_low == hit[1]):
            return hit[0]
    return None


#: What may follow a self-negating cue whose clause is its subject ("the awning was missing from
#: the van", "the payment failed"), unlike its object ("missing an item") or a verb ("fails to
#: charge", which negates the charging); "" is the text's end.
_ENDS_NEGATED_SUBJECT = frozenset("""
from in on at for since when after again and or but so because completely entirely totally now today
""".split()) | {""}

#: Verbs whose "from X-ing" negates X ("stop the app from updating", "keep the pipes from freezing").
_STOPPERS = frozenset({"stop", "stops", "stopped", "prevent", "prevents", "keep", "keeps", "block", "blocks"})
#: Nouns after which "in" names no direction: "in advance" is not the opposite of "out".
_IN_IDIOMS = frozenset({"advance", "case", "general", "particular", "fact", "addition", "total", "order"})
#: Words that end one clause and open another ("the hot water works but the heating doesn't").
_CLAUSE_BREAKS = frozenset({"but", "while", "whereas", "although", "though"})
_WHICH_WEEK = frozenset({"next", "last", "following", "coming", "previous"})
_AUXILIARIES = frozenset("do does did is are was were have has had can could will would should must shall may might".split())
_WH = frozenset("why how what when where which who whom whose".split())


def _with_no(raw: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
    """"with no" read as "without" ("a room with no window" asks what "a room without a window"
    asks; else "with" would be the antonym of the other text's "without")."""
    out: list[tuple[str, bool]] = []
    for tok, initial in raw:
        if tok.lower() == "no" and out and out[-1][0].lower() == "with":
            out[-1] = ("without", out[-1][1])
        else:
            out.append((tok, initial))
    return out


def _audiences(lower_tokens: list[str]) -> dict[int, str]:
    """The AUDIENCES groups named, by single words or hyphenated pairs ("self-employed"), each
    with the word that named it."""
    found: dict[int, str] = {}
    for i, w in enumerate(lower_tokens):
        pair = f"{lower_tokens[i - 1]}-{w}" if i else ""
        for key in (pair, w, w[:-1] if w.endswith("s") else ""):
            group = _AUDIENCE_GROUP.get(key)
            if group is not None:
                found.setdefault(group, key)
                break
    return found


def _parse_number_words(ws: list[str]) -> float:
    """``["two", "hundred", "fifty"]`` -> 250; ``["twenty", "five"]`` -> 25."""
    total, current = 0.0, 0.0
    for w in ws:
        if w in lx.NUMBER_SCALES:
            scale = lx.NUMBER_SCALES[w]
            current = (current or 1) * scale
            if scale >= 1000:
                total, current = total + current, 0.0
        else:
            current += lx.NUMBER_WORDS[w]
    return total + current


def typo_equal(a: str, b: str) -> bool:
    """Two stems a typing slip apart: one edit or neighbour swap, both at least 5 letters long."""
    return a == b or (min(len(a), len(b)) >= 5 and _damerau1(a, b))


def slip_equal(a: str, b: str) -> bool:
    """:func:`typo_equal`, or a letter left out, added or swapped in a stem of four letters
    ("renw" / "renew"; not one letter for another: "card" / "cart" are two words)."""
    return typo_equal(a, b) or (min(len(a), len(b)) >= 4 and _damerau1(a, b)
                                and (len(a) != len(b) or sorted(a) == sorted(b)))

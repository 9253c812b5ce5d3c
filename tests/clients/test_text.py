"""The text normaliser: what it folds, what it must keep, and its versioned keys."""
import pytest

from kvcached_client.text import NORMALIZATION_VERSION, normalize, normalize_messages, text_key


@pytest.mark.parametrize("raw, want", [
    # Full-width Latin letters, digits and punctuation fold to ASCII (NFKC).
    ("ＨＥＬＬＯ，Ｗｏｒｌｄ！１２３", "HELLO,World!123"),
    ("（注意）：ｏｋ？", "(注意):ok?"),
    # Runs of whitespace (tabs, newlines, the ideographic space) collapse; ends are stripped.
    ("  hello \t\n  world  ", "hello world"),
    ("你好\u3000世界", "你好世界"),
    # No space next to Chinese or Japanese characters (writers add them inconsistently) ...
    ("5G 套餐 怎么 办理", "5G套餐怎么办理"),
    ("收不到 ， 怎么办", "收不到,怎么办"),
    ("《 红楼梦 》 的 作者", '"红楼梦"的作者'),
    ("MySQL 怎么 备份", "MySQL怎么备份"),
    ("こんにちは 世界", "こんにちは世界"),
    # ... but between Latin words, and in Korean (spaces separate its words), they stay.
    ("HTTP 404 错误", "HTTP 404错误"),
    ("안녕하세요 세계", "안녕하세요 세계"),
    # CJK punctuation and typographic quotes map to one form.
    ("如何关闭深色模式。", "如何关闭深色模式."),
    ("苹果、香蕉、橙子", "苹果,香蕉,橙子"),
    ("「引用」和《书名》", '"引用"和"书名"'),
    ("“smart” ‘quotes’", "\"smart\" 'quotes'"),
    ("wait…", "wait..."),
    ("zero\u200bwidth", "zerowidth"),
])
def test_folds(raw, want):
    assert normalize(raw) == want


@pytest.mark.parametrize("a, b", [
    ("order 1234", "order 1243"),        # digits are kept: two orders never become one key
    ("Order 12", "order 12"),            # case is kept
    ("US policy", "us policy"),
    ("如何关闭深色模式？", "如何打开深色模式？"),  # different characters stay different
    ("cancel my plan", "don't cancel my plan"),
])
def test_keeps_what_changes_meaning(a, b):
    assert normalize(a) != normalize(b)
    assert text_key(a) != text_key(b)


def test_idempotent_and_width_insensitive_keys():
    raw = "  ＡＰＩ　ｋｅｙ：「abc」。 "
    assert normalize(normalize(raw)) == normalize(raw)
    assert text_key("tenant", "m", raw) == text_key("tenant", "m", 'API key:"abc".')


def test_key_parts_are_delimited_and_versioned():
    assert text_key("ab", "c") != text_key("a", "bc")
    assert text_key("x") != text_key("x", version=NORMALIZATION_VERSION + 1)


def test_messages_and_type_errors():
    msgs = [{"role": "user", "content": "Ｈｉ  there"},
            {"role": "user", "content": [{"type": "text", "text": "ａ\u3000b"}, {"type": "image_url"}]}]
    out = normalize_messages(msgs)
    assert out[0]["content"] == "Hi there"
    assert out[1]["content"][0]["text"] == "a b" and out[1]["content"][1] == {"type": "image_url"}
    assert msgs[0]["content"] == "Ｈｉ  there"  # the input is not modified
    with pytest.raises(TypeError):
        normalize(b"bytes")  # type: ignore[arg-type]

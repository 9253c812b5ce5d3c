"""Small word lists the guards read: function words, fillers, negation cues, antonyms, number
and date words, and a few stopwords per language for telling languages apart.

English only, lower case, surface forms; :func:`stem` is applied to both the lists and the text,
so "closed", "closes" and "close" meet. The lists are general-purpose (what a newcomer would
write down for "words that flip or scope a question"), not a dictionary: a pair missing here is
left to the calibrated threshold.
"""

from __future__ import annotations


def stem(word: str) -> str:
    """A crude suffix stripper, the same on both sides of every comparison: ``closed`` ->
    ``clos``, ``close`` -> ``clos``, ``policies`` -> ``policy``, ``stopped`` -> ``stop``."""
    w = word.lower()
    if w in IRREGULAR_FORMS:
        return IRREGULAR_FORMS[w]
    if len(w) > 4 and w.endswith("ies"):
        return w[:-3] + "y"
    for suffix in ("ing", "ed", "es", "s"):
        if w.endswith(suffix) and len(w) - len(suffix) >= 3:
            if suffix == "s" and w.endswith(("ss", "us", "is")):
                break
            w = w[: -len(suffix)]
            if suffix in ("ing", "ed") and len(w) >= 4 and w[-1] == w[-2] and w[-1] not in "lsz":
                w = w[:-1]
            if suffix == "es" and w.endswith("e"):
                return w  # employees -> employe, as employee (not employ)
            break
    else:
        if w.endswith("ly") and len(w) >= 6:  # lawfully -> lawful, legally -> legal
            w = w[:-2]
    if len(w) > 3 and w.endswith("e"):
        w = w[:-1]
    return w


#: Forms the suffix stripper cannot bring to their verb's stem: short verbs ("used" / "use") and
#: common irregular past forms ("bought" / "buy"), each mapped to what ``stem`` makes of the verb.
IRREGULAR_FORMS = {"used": "use", "uses": "use", "using": "use", "bought": "buy", "paid": "pay",
                   "made": "mak", "sent": "send", "sold": "sell", "took": "tak", "taken": "tak", "gave": "giv",
                   "given": "giv", "went": "go", "gone": "go", "lost": "los", "spent": "spend", "brought": "bring",
                   "kept": "keep", "got": "get", "gotten": "get", "saw": "see", "seen": "see", "ran": "run"}


#: Words that carry little of a question's meaning: articles, auxiliaries, modals, first- and
#: second-person pronouns, light prepositions. Negation, direction, quantity and third persons
#: are deliberately not here (they change answers).
FUNCTION_WORDS = frozenset("""
a an the this that these those it its itself
i me my mine myself you your yours yourself we us our ours ourselves
do does did doing done be is are was were been being am have has had having get got
can could may might must shall should will would
of for with at by to from as about into onto upon via per
and or but if then so than too also just
what which there here some any o'clock whats hows whos wheres whens im ive id youre
""".split())

#: Contractions typed without the apostrophe; they negate like their spelt-out forms.
BARE_NEGATIVES = {"dont": "do", "doesnt": "does", "didnt": "did", "cant": "can", "wont": "will",
                  "isnt": "is", "arent": "are", "wasnt": "was", "werent": "were", "shouldnt": "should",
                  "couldnt": "could", "wouldnt": "would", "havent": "have", "hasnt": "has", "mustnt": "must"}

#: Prepositions that mean little on their own; the negation guard still reads them (on/off,
#: in/out, over/under), the word-overlap measure does not.
LIGHT_PREPOSITIONS = frozenset("on in at off out up down over under before after above below within".split())

#: Conversational padding that changes no answer: hesitations, greetings, politeness.
FILLERS = frozenset("""
um uh er erm hmm ah oh like yeah okay ok well hi hello hey hiya please pls thanks thank cheers
sorry bother silly quick question wondering tell actually basically really kindly
usually normally typically generally possible
""".split())

#: Greetings that are padding only at the very start of a text ("Morning! How do I...").
LEADING_GREETINGS = frozenset({"morning", "afternoon", "evening", "good", "team", "there", "all"})

#: Negation cues that negate the event they name ("the payment failed"), not the word after them.
SELF_NEGATING = frozenset("""
fail fails failed failing none nothing nobody nowhere
reject rejects rejected decline declines declined deny denies denied missing
""".split())

#: Words that negate what follows (contractions are expanded to "not" before counting), and the
#: self-negating ones.
NEGATION_CUES = frozenset("""
not no never neither nor without cannot avoid avoiding avoids avoided non
unable except instead rather refuse refuses refused refusing
hardly barely scarcely rarely seldom lack lacks lacked lacking unless
""".split()) | SELF_NEGATING

#: Verbs that negate the activity right after them ("stop watering", "quit smoking"), and only
#: then: "stop my membership from renewing" and "stop a process" are actions, not negations.
STOP_WORDS = frozenset({"stop", "stopped", "stops", "quit", "cease"})

#: Prefixes of opposite meaning on the same word: overweight / underweight, preorder / postorder.
OPPOSITE_PREFIXES: tuple[tuple[str, str], ...] = (("over", "under"), ("pre", "post"), ("up", "down"))

#: Capitalised abbreviations of common things, not names: "my GP" is "my doctor", "an ATM" a
#: cash machine (a name, "AWS", "Chrome", must appear on both sides; these need not).
COMMON_ABBREVIATIONS = frozenset("gp atm pin sms faq hr pc id diy vip ok asap fyi dr mr mrs ms mx prof".split())

#: Names with digits in them that are no numbers ("K8s" is Kubernetes, "S3" a product): still
#: names (the entity guard compares them), but their digits are not read as values.
DIGIT_NAMES = frozenset("k8s i18n l10n a11y s3 ec2 mp3 mp4 h264 h265 x86 arm64 b2b b2c p2p".split())

#: Other names of the same country, company or thing in English text ("a UK passport" is "a
#: British passport"): one side's name is named by the other when it has any name of the group.
ALIASES: tuple[tuple[str, ...], ...] = (
    ("uk", "british", "britain", "england", "english"), ("us", "usa", "american", "americans", "america"),
    ("aws", "amazon"), ("2fa", "mfa"), ("eu", "european", "europe"), ("gcp", "google"),
    ("nyc", "york"), ("la", "angeles"), ("k8s", "kubernetes"), ("js", "javascript"), ("ts", "typescript"),
)

#: Prefixes that negate the word they are attached to: w vs un+w is a negation ("non-" is a
#: word of its own once hyphens split words, and a negation cue).
NEGATING_PREFIXES = ("un", "non", "dis", "in", "im", "il", "ir", "de", "mis")

#: Pairs whose two sides ask opposite questions. Each side may list several words.
ANTONYMS: tuple[tuple[str, str], ...] = (
    ("open", "close closed shut"), ("on", "off"), ("in into", "out"), ("enable", "disable"),
    ("include included inclusive cover covered", "exclude excluded exclusive omit missing"), ("add", "remove delete"),
    ("increase raise bigger larger higher", "decrease reduce lower smaller less fewer"), ("upgrade", "downgrade"),
    ("accept approve approved", "decline reject rejected refuse deny denied"), ("remember", "forget forgot forgotten"),
    ("follow follows followed obey", "ignore ignores ignored"),
    ("allow allowed permit permitted legal lawful",
     "ban banned forbid forbidden prohibit prohibited illegal unlawful block blocked"),
    ("eat take", "avoid"), ("eat", "remove"), ("tight", "loose"), ("borrow", "return"), ("running", "cancelled canceled"),
    ("benefit advantage pro", "drawback disadvantage con downside risk"), ("best", "worst"),
    ("most", "least"), ("more", "less fewer"), ("maximum max", "minimum min"),
    ("highest", "lowest"), ("high", "low"), ("hot warm", "cold cool"), ("big large", "small"),
    ("long", "short"), ("early", "late"), ("before", "after"), ("start begin", "stop end finish"),
    ("pause", "resume"), ("join enrol enroll", "leave withdraw quit cancel"), ("pass", "fail"),
    ("success succeed succeeded successful successfully manage managed", "failure fail fails failed"),
    ("win", "lose"), ("buy", "sell"), ("import", "export"),
    ("upload", "download"), ("send", "receive"), ("lend", "borrow"), ("deposit", "withdraw"),
    ("credit", "debit"), ("profit", "loss"), ("true", "false"), ("yes", "no"),
    ("right", "wrong"), ("safe", "dangerous"), ("spicy", "mild"), ("busy", "quiet"),
    ("grant", "revoke"), ("show public visible", "hide hidden private"),
    ("compulsory mandatory required", "optional"), ("free", "paid"), ("cheap", "expensive"),
    ("fast quick", "slow"), ("new", "old"), ("first", "last"), ("entry", "exit"),
    ("arrival arrive", "departure depart"), ("inbound", "outbound"), ("input", "output"),
    ("plus", "minus"), ("positive", "negative"), ("male", "female"), ("man men", "woman women"),
    ("boy", "girl"), ("left", "right"), ("up", "down"), ("above", "below"), ("over", "under"),
    ("inside", "outside"), ("internal", "external"), ("domestic home local", "international abroad overseas"),
    ("north", "south"), ("east", "west"), ("day", "night"), ("summer", "winter"),
    ("light", "dark"), ("black", "white"), ("love like", "hate dislike"), ("wet", "dry"),
    ("full", "empty part"), ("lock", "unlock"), ("mute", "unmute"), ("subscribe", "unsubscribe"),
    ("connect", "disconnect"), ("install", "uninstall"), ("merge", "split"),
    ("with", "without"), ("within", "after outside"), ("overpay", "underpay"),
    ("outstanding good", "inadequate bad poor"),
    ("healthy", "unhealthy"), ("improve", "damage worsen"), ("help", "harm"), ("push", "pull"),
    ("employed", "unemployed"), ("work working functioning", "broken faulty fault malfunctioning dead"),
    ("online digital", "paper offline store post person"),
    ("expand", "collapse"), ("attach", "detach"), ("boil boiling", "freeze freezing"),
    ("formal", "casual informal"), ("hire", "fire"), ("inhale", "exhale"), ("encrypt", "decrypt"),
    ("ascending", "descending"), ("minimize minimise", "maximize maximise"), ("sunrise", "sunset"),
    ("gain", "lose"), ("rise", "fall"), ("lengthen", "shorten"), ("tighten", "loosen"), ("undo", "redo"),
    ("save keep", "discard"), ("bold", "italic"), ("direct nonstop", "connecting layover stopover"),
    ("single", "married double"), ("vegetarian", "vegan"), ("savings", "checking"),
    ("reply", "forward"), ("newest latest", "oldest earliest"),
    ("all every everyone everybody entire whole", "some few single individual one specific particular"),
    ("clean", "dirty"), ("maternity", "paternity"),
    ("must", "may"), ("hard", "soft"),
)

#: A verb and a particle a few words after it that together mean another verb ("take the money
#: out of my ISA", "cut out the background": remove): (verb, particle, the verb they make, a word
#: that must follow the particle or ""). "take out a loan" gets one, so "take ... out" removes
#: only before "of". Not "avoid" for "cut out": a connection that cuts out stops working.
PHRASAL_VERBS: tuple[tuple[str, str, str, str], ...] = (
    ("take", "out", "remove", "of"), ("cut", "out", "remove", ""), ("sign", "up", "join", ""),
)

#: Hyphenated words and set phrases read as the plainer words they mean: "long-haul" flights leave
#: the country (the opposite of "domestic" ones); a lift "out of order" is not working, as one that
#: "isn't working" is (one negation on each side, not a cue on one only).
SET_PHRASES = {"long-haul": "international", "short-haul": "domestic", "out of order": "not working",
               "out of action": "not working", "out of service": "not in service", "out of stock": "not in stock",
               "fully booked": "not available", "sold out": "not available"}


#: Words that say how a question is asked, not what it asks about ("How do I ...?" / "What's the
#: best way to ...?" / "Where can I ...?"): never the word a question's frame turns on.
ASKING_WORDS = frozenset("""
how what where why when which who whom way ways best good easiest quickest right correct proper properly
help step steps possible able process procedure option options method methods tip tips advice need want
many much
""".split())

#: Prepositions that say where or when, which a frame's slot may turn on ("customers in the EU" /
#: "customers outside the EU"), though they carry too little to compare anywhere else.
SLOT_PREPOSITIONS = frozenset("in inside within outside before after during".split())
#: Of those, the ones that place a time against an event: a slot with one of them differs from a
#: slot with another word, whatever that word ("cancel before the day" / "cancel on the day").
TIME_RELATIONS = frozenset("before after during until".split())

#: Everyday words of one meaning in a help-desk question ("enable dark mode" / "turn on dark
#: mode"): one group, one meaning. General English, not a thesaurus: a pair of words in one
#: frame that are not here is read as two questions.
SYNONYMS: tuple[str, ...] = (
    "enable activate turn switch", "disable deactivate", "log sign", "update change edit modify amend alter",
    "all every each entire whole", "buy purchase", "fix repair mend", "delete remove erase",
    "cancel terminate", "get obtain receive", "find locate", "see view check show display", "start begin",
    "stop end prevent", "phone mobile cell smartphone", "transfer move", "flat apartment", "car vehicle", "photo picture image",
    "film movie", "shop store", "big large", "small little", "fast quick", "cost price fee charge",
    "bill invoice", "send email", "reset restore", "set configure", "make create", "book reserve",
    "doctor gp physician", "medicine medication drug", "kid child", "job work", "rent hire", "go travel",
    "return bring give", "pay settle", "trip journey", "ill sick unwell", "allowed permitted", "foot walk",
)

#: Who a question is about or for; words in one group mean the same audience. A question for
#: adults is not one for children, nor an employee's one a contractor's.
AUDIENCES: tuple[str, ...] = (
    "adult adults grown-up grown-ups", "child children kid kids toddler toddlers", "baby babies infant infants",
    "teenager teenagers teen teens youth youths junior juniors", "senior seniors pensioner pensioners elderly retiree retirees",
    "student students pupil pupils", "undergraduate undergraduates", "postgraduate postgraduates master's masters phd",
    "beginner beginners novice novices newbie newbies", "expert experts",
    "employee employees hire hires new-hire", "individual individuals personal", "family families household",
    "business businesses company companies corporate", "self-employed freelancer freelancers", "contractor contractors",
    "visitor visitors guest guests", "resident residents", "tenant tenants renter renters", "landlord landlords",
    "homeowner homeowners", "nonprofit nonprofits charity charities", "colleague colleagues",
    "mother mum mom father dad parent parents", "women woman ladies female", "men man male",
    "son daughter", "friend friends", "pregnant", "spouse spouses husband wife",
    "veteran veterans", "patient patients", "puppy puppies", "kitten kittens", "dog dogs", "cat cats",
    "economy", "business-class first-class premium-economy",
)

#: Colours: a closed class that names which thing is meant ("the red light" is not "the blue").
COLOURS = frozenset("red blue green yellow black white orange purple pink brown grey gray silver gold".split())

#: Closed classes of which two texts that both name one must name the same: units and currencies
#: ("5 km" is not "5 miles", tablespoons are not teaspoons, a price in dollars not one in euros)
#: and ways to travel ("by train" is not "by bus"). Each string is one member's names; a text
#: that names none of a class is not compared on it ("cancel my flight" / "cancel my booking").
UNITS: tuple[str, ...] = (
    "km kms kilometer kilometers kilometre kilometres", "mile miles", "meter meters metre metres",
    "cm centimeter centimeters centimetre centimetres", "mm millimeter millimeters millimetre millimetres",
    "inch inches", "ft foot feet", "yard yards", "kg kgs kilo kilos kilogram kilograms", "gram grams",
    "lb lbs pound pounds", "oz ounce ounces", "liter liters litre litres",
    "ml milliliter milliliters millilitre millilitres", "gallon gallons", "pint pints", "quart quarts",
    "tablespoon tablespoons tbsp", "teaspoon teaspoons tsp", "celsius centigrade", "fahrenheit", "kelvin",
    "mph", "kph", "kb kilobyte kilobytes", "mb megabyte megabytes", "gb gigabyte gigabytes",
    "tb terabyte terabytes", "calorie calories kcal", "kilojoule kilojoules kj", "acre acres",
    "hectare hectares", "watt watts", "kilowatt kilowatts kw kwh", "volt volts", "amp amps ampere amperes",
    "dollar dollars usd buck bucks", "euro euros eur", "yen jpy", "yuan rmb cny renminbi", "rupee rupees inr",
    "peso pesos", "franc francs chf", "krw", "rouble roubles ruble rubles", "bitcoin bitcoins btc",
)
#: Units of time: "after 2 weeks" is not "after 2 months" (the numbers alone agree).
TIME_UNITS: tuple[str, ...] = (
    "second seconds sec secs", "minute minutes min mins", "hour hours hr hrs", "day days", "week weeks",
    "fortnight fortnights", "month months", "year years", "decade decades",
)
#: Closed classes that fill a template's slot (the slot guard): sizes ("in size medium" is not
#: "in size large"), diets ("a vegetarian option" is not "a gluten-free one"; words split at
#: hyphens), seats ("a window seat" / "an aisle seat"), beds ("a king bed" / "twin beds"),
#: delivery speeds ("express" / "standard shipping"), cooking appliances ("in the oven" / "in an
#: air fryer").
SIZES: tuple[str, ...] = ("xxs", "xs", "small", "medium", "large", "xl", "xxl", "xxxl")
DIETS: tuple[str, ...] = ("vegetarian", "vegan", "pescatarian", "gluten", "dairy lactose", "halal", "kosher",
                          "keto", "paleo")
SEATS: tuple[str, ...] = ("window", "aisle", "middle")
GEARBOXES: tuple[str, ...] = ("automatic", "manual")
#: How a bill is paid: "by direct debit" is not "by card over the phone", nor "in cash".
PAYMENTS: tuple[str, ...] = ("cash", "card cards", "cheque cheques", "debit autopay", "paypal")
BEDS: tuple[str, ...] = ("king", "queen", "twin twins", "double")
DELIVERY: tuple[str, ...] = ("express", "standard", "overnight", "economy", "priority")
APPLIANCES: tuple[str, ...] = ("oven", "microwave", "fryer", "grill", "stove hob", "toaster", "steamer",
                               "barbecue bbq", "cooker", "pan skillet", "wok")
TRANSPORT: tuple[str, ...] = (
    "train trains rail railway", "bus buses", "car cars driving", "taxi taxis cab cabs uber",
    "plane planes flight flights flying airplane", "ferry ferries boat boats", "bike bikes bicycle bicycles cycling",
    "walking foot", "subway metro", "tram trams", "motorbike motorcycle scooter",
)

#: Number words (values); "one" is left out: "a quick one", "which one" are not numbers.
NUMBER_WORDS: dict[str, float] = {  # "half", "quarter": fractions
    "zero": 0, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8,
    "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13, "fourteen": 14,
    "fifteen": 15, "sixteen": 16, "seventeen": 17, "eighteen": 18, "nineteen": 19, "twenty": 20,
    "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70, "eighty": 80, "ninety": 90,
    "second": 2, "third": 3, "fourth": 4, "fifth": 5, "sixth": 6, "seventh": 7, "eighth": 8,
    "ninth": 9, "tenth": 10, "twice": 2, "double": 2, "triple": 3, "dozen": 12, "half": 0.5,
    "quarter": 0.25,
}
NUMBER_SCALES: dict[str, int] = {"hundred": 100, "thousand": 1000, "million": 10**6, "billion": 10**9}

#: Letters written straight after a number that are its unit, not part of an id ("10GB", "7pm").
NUMBER_UNITS = frozenset("""
st nd rd th am pm k m bn x h hr hrs min mins s ms g kg mg lb lbs oz ml l cl km cm mm mi ft in
mph kmh kb mb gb tb kwh kw w v mah p
""".split())

WEEKDAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
MONTHS = ("january", "february", "march", "april", "may", "june", "july", "august", "september",
          "october", "november", "december")
#: Words that name a time on their own.
DATE_WORDS = frozenset(WEEKDAYS + MONTHS + (
    "today", "tomorrow", "yesterday", "tonight", "weekday", "weekend", "morning", "afternoon",
    "evening", "night", "overnight", "midnight", "noon", "midday", "spring", "summer", "autumn",
    "winter", "weekly", "monthly", "yearly", "daily", "hourly", "fortnightly"))
#: How often, not when: compared only when both texts say it ("the daily limit" asks what "the
#: limit per day" asks).
FREQUENCY_WORDS = frozenset({"daily", "weekly", "monthly", "yearly", "hourly", "fortnightly"})
#: Spellings of the same period.
DATE_ALIASES = {"annually": "yearly"}
#: Half-day markers and the words that fall inside them ("7pm" vs "seven this evening").
HALF_DAYS = {"am": frozenset({"morning"}), "pm": frozenset({"afternoon", "evening", "night", "tonight"})}
#: Words for a currency written after an amount ("fifty pounds" is "£50").
CURRENCY_WORDS = {"pound": "£", "pounds": "£", "quid": "£", "gbp": "£", "dollar": "$", "dollars": "$",
                  "usd": "$", "euro": "€", "euros": "€", "eur": "€", "yen": "¥", "jpy": "¥"}
#: Words that make a date out of the unit after them: "next week", "same day", "last year".
DATE_RELATIVE = frozenset({"next", "last", "previous", "this", "same", "coming", "following", "first", "final"})
DATE_UNITS = frozenset({"day", "week", "month", "year", "weekend", "quarter", "term", "fortnight",
                        "season", "hour", "time"})

#: A few frequent words that are each specific to one language (none shared with English).
LANGUAGE_STOPWORDS: dict[str, frozenset[str]] = {
    "en": frozenset("the is are do does how what why where when which who my your can i you".split()),
    "es": frozenset("el los las es cómo como qué por para mi tu puedo hacer está son una del".split()),
    "fr": frozenset("le les est comment quoi pourquoi mon ma mes je vous des une où puis faire".split()),
    "de": frozenset("der die das ist wie was warum wo mein meine ich kann sie ein eine nicht und".split()),
    "it": frozenset("il gli è come cosa perché dove mio mia posso sono della che non una".split()),
    "pt": frozenset("o os é como porque onde meu minha eu posso fazer uma não você".split()),
    "nl": frozenset("het is hoe wat waarom waar mijn ik kan een niet van zijn".split()),
}
#: Letters that point to a language on their own.
LANGUAGE_LETTERS: dict[str, str] = {"ñ": "es", "¿": "es", "¡": "es", "ß": "de", "ä": "de", "ö": "de",
                                    "ü": "de", "ç": "fr", "ê": "fr", "è": "fr", "à": "fr", "ã": "pt",
                                    "õ": "pt", "ì": "it", "ò": "it"}

"""Inputs of `tokenmill bench embed`: hand-written sentences for the parity check, and
generated sentences of a set word range for the throughput run.

The parity set mixes lengths (one word to a paragraph), punctuation, numbers, code, URLs,
emoji and text in other languages and scripts, so that tokenization edge cases, long and short
sequences and [UNK]-heavy inputs are all compared.
"""

from __future__ import annotations

import random

PARITY_SENTENCES: tuple[str, ...] = (
    "Hello!",
    "Yes.",
    "Why?",
    "cat",
    "The cat sat on the mat.",
    "A man is playing a guitar on the street corner.",
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings map sentences to points in a vector space.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "I can't believe it's already 3:45 p.m. -- we're late!",
    "Order #4471 shipped on 2024-03-15 and arrived two days later.",
    "The total came to $1,299.99 after a 15% discount.",
    "Pi is approximately 3.14159265358979, and e is about 2.71828.",
    "Water boils at 100 °C (212 °F) at sea level.",
    "Call me at +1 (555) 010-7788, extension 42.",
    "Version 2.10.3 fixes the regression introduced in 2.10.0.",
    "def add(a, b): return a + b",
    "SELECT name, email FROM users WHERE created_at > '2023-01-01';",
    "for (int i = 0; i < n; ++i) { sum += values[i]; }",
    "See https://example.com/docs?page=2&lang=en for details.",
    "Send questions to support@example.org before Friday.",
    "Wow!!! This is sooo good :) :) :)",
    "\"Quoted,\" she said, 'and nested: \"deeply\".'",
    "Semi-colons; colons: dashes -- and ellipses... all here.",
    "(Parenthetical remarks [with brackets] {and braces}) are fine.",
    "ALL CAPS SENTENCES SHOULD STILL EMBED THE SAME AS LOWER CASE ONES.",
    "mIxEd CaSe TeXt Is NoRmAlIzEd By An UnCaSeD TokEnIzEr.",
    "I love this movie 😍🎬🍿",
    "The weather today: ☀️ then 🌧️ then ⛈️.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "Ich habe gestern drei Bücher in der Stadtbibliothek ausgeliehen.",
    "Le chat dort sur le canapé depuis ce matin.",
    "Nous avons réservé une table pour huit personnes à 20 h 30.",
    "El niño juega al fútbol en el parque con sus amigos.",
    "¿Dónde está la estación de tren más cercana?",
    "Il pranzo è servito alle tredici in punto.",
    "O rato roeu a roupa do rei de Roma.",
    "De kat zit op de vensterbank en kijkt naar de vogels.",
    "Kissa istuu ikkunalaudalla ja katselee lintuja.",
    "Katten sitter i fönstret och tittar på fåglarna.",
    "Кошка сидит на окне и смотрит на птиц.",
    "Москва — столица России, а Киев — столица Украины.",
    "Η γάτα κάθεται στο παράθυρο.",
    "Kedi pencerede oturuyor ve kuşlara bakıyor.",
    "Kot siedzi na parapecie i patrzy na ptaki.",
    "猫が窓辺に座って鳥を見ています。",
    "東京は日本の首都です。",
    "我今天早上喝了一杯咖啡。",
    "机器学习是人工智能的一个分支。",
    "고양이가 창가에 앉아 새를 보고 있다.",
    "القطة تجلس على النافذة وتنظر إلى الطيور.",
    "החתול יושב על אדן החלון.",
    "बिल्ली खिड़की पर बैठी है और पक्षियों को देख रही है।",
    "แมวนั่งอยู่ที่หน้าต่าง",
    "Con mèo đang ngồi trên bậu cửa sổ.",
    "Naïve café owners in Zürich serve crème brûlée.",
    "The résumé of the señor was très impressive.",
    "Two sentences here. And a second one that follows the first.",
    "Line one\nline two\nline three",
    "Tabs\tbetween\twords\tshould\tnot\tmatter\tmuch.",
    "     Leading and trailing spaces.     ",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "antidisestablishmentarianism",
    "Pneumonoultramicroscopicsilicovolcanoconiosis is a very long word.",
    "The mitochondria is the powerhouse of the cell.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "The stock market fell sharply after the central bank raised interest rates.",
    "Our quarterly revenue grew 12% year over year, driven by subscriptions.",
    "Please reset my password; I no longer have access to my old email.",
    "How do I cancel my subscription and get a refund?",
    "The package was left at the wrong address again.",
    "Can you recommend a good Italian restaurant nearby?",
    "What is the difference between a list and a tuple in Python?",
    "Explain the theory of relativity in simple terms.",
    "Who wrote 'Pride and Prejudice'?",
    "The patient reported mild headaches and occasional dizziness.",
    "Take two tablets every eight hours with food.",
    "The defendant pleaded not guilty to all charges.",
    "The contract terminates automatically unless renewed in writing.",
    "Rain is expected throughout the weekend in the northern regions.",
    "A magnitude 5.8 earthquake struck off the coast early Tuesday.",
    "The team won the championship after a dramatic penalty shootout.",
    "She finished the marathon in 3 hours, 12 minutes and 40 seconds.",
    "Preheat the oven to 180 degrees and grease a round cake tin.",
    "Whisk the eggs with sugar until pale, then fold in the flour.",
    "The museum is closed on Mondays and public holidays.",
    "Our flight was delayed by four hours due to fog in Amsterdam.",
    "The new phone has a 6.1-inch screen and a 48-megapixel camera.",
    "Restart the router if the connection keeps dropping.",
    "Error 404: the requested page could not be found.",
    "Traceback (most recent call last): ValueError: invalid literal for int()",
    "The GPU ran out of memory while loading the 70B model.",
    "Continuous batching keeps the accelerator busy between requests.",
    "Retrieval-augmented generation grounds answers in documents.",
    "Vector databases index embeddings for fast nearest-neighbour search.",
    "Cosine similarity measures the angle between two vectors.",
    "To be, or not to be, that is the question.",
    "All happy families are alike; each unhappy family is unhappy in its own way.",
    "It was the best of times, it was the worst of times.",
    "In the beginning was the Word.",
    "The only thing we have to fear is fear itself.",
    ("Once upon a time, in a small village nestled between two rolling hills, there lived an "
     "old clockmaker who repaired every clock in the region, and who, despite his age, still "
     "walked to the market each morning to buy fresh bread and talk with his neighbours."),
    ("The committee reviewed the proposal in detail, considered the objections raised by the "
     "residents, weighed the environmental impact against the economic benefits, and finally "
     "voted seven to two in favour of building the new bridge across the river."),
    ("Large language models are trained on vast amounts of text; they learn statistical "
     "patterns of language, which lets them complete sentences, answer questions, translate "
     "between languages and even write code, although they can also produce confident but "
     "incorrect statements."),
    ("Im Sommer fahren wir oft an die Ostsee, wo wir lange Spaziergänge am Strand machen, "
     "frischen Fisch essen und abends den Sonnenuntergang über dem Meer beobachten."),
    ("Quand nous étions enfants, nous passions toutes nos vacances chez nos grands-parents, "
     "à la campagne, où nous aidions à ramasser les pommes et à nourrir les poules."),
    " ".join(["repeat"] * 40),
    " ".join(str(n) for n in range(100, 160)),
    "x",
    "?!",
    "...",
    "🙂",
)


# Plain words for generated sentences: common English, so the token count per word is
# about what real text has.
_WORDS = (
    "the of and to in is was for on that with as by at from it this be are an or which not but "
    "have had has one all were they we their been more when there can some would time two into "
    "people other new year work first many may system could these such also over only most data "
    "model city water house school market language engine request server memory question answer "
    "river mountain garden student teacher doctor morning evening report project result change "
    "simple quickly carefully between during before after because however although several "
    "important different general public local national small large early late strong clear "
    "open close build write read learn find give take make show keep begin follow create "
    "improve measure compare explain describe support provide include require remain become"
).split()


def generated_sentences(count: int, min_words: int = 10, max_words: int = 60,
                        seed: int = 0) -> list[str]:
    """``count`` sentences of ``min_words`` to ``max_words`` words (uniformly), reproducible
    from ``seed``."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        words = rng.choices(_WORDS, k=rng.randint(min_words, max_words))
        out.append(" ".join(words).capitalize() + ".")
    return out

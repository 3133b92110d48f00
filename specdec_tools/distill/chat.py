"""Everyday-chat training prompts: what users ask about, not what the standard library documents.

No dataset can be downloaded here, so the prompts are made: a broad seed list of topics in many
domains (TOPICS, and a second list MORE_TOPICS for `--chat-topics more|all`), crossed with task kinds (explain, advise, list, compare, write, rewrite, summarize,
explain to a child, ...), plus generated ones: math word problems, translation requests, code in
several languages, and questions the target itself writes about each topic (self-instruct, Wang
et al. 2023: the target is asked for user questions at temperature 0.8, with three example
questions; answers are deduplicated and filtered). The held-out split is by *topic*: `crc32(topic) % 100 < heldout_pct` goes to
evaluation and training never sees a prompt about it: self-instruct questions and training rows
that name a held-out topic are dropped (`mentioned_topic`), and evaluation asks only the
topic-bound tasks (rewrites, math and code requests do not depend on the topic, so the same ones
are training prompts).

Answers are the target's own (sequence-level distillation, specdec_tools.distill.answers), greedy and
sampled, so that the draft learns the target's distribution and not only its argmax.
"""
from __future__ import annotations

import json
import random
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

TOPICS: dict[str, list[str]] = {
    "everyday life": ["morning routines", "keeping a tidy home", "doing laundry", "saving energy at home",
                      "moving to a new city", "making friends as an adult", "planning a birthday party",
                      "choosing a gift", "dealing with noisy neighbours", "time management"],
    "food and cooking": ["baking bread", "cooking rice", "vegetarian meals", "meal planning on a budget",
                         "making soup", "knife skills", "fermenting vegetables", "brewing coffee",
                         "spices in Indian cooking", "food safety in the kitchen"],
    "health and fitness": ["running for beginners", "stretching", "drinking enough water", "stress",
                           "healthy breakfasts", "strength training", "posture at a desk", "the common cold",
                           "meditation", "walking every day"],
    "travel": ["packing light", "travelling by train in Europe", "jet lag", "visiting Japan",
               "camping", "road trips", "travel insurance", "learning phrases before a trip",
               "travelling with children", "budget travel"],
    "science": ["photosynthesis", "black holes", "the water cycle", "plate tectonics", "DNA",
                "the speed of light", "volcanoes", "magnetism", "the immune system", "evolution",
                "climate change", "rainbows", "the moon's phases", "electricity", "atoms"],
    "history": ["the Roman Empire", "the printing press", "the Industrial Revolution", "ancient Egypt",
                "the French Revolution", "the Silk Road", "the first moon landing", "the Renaissance",
                "the invention of the telephone", "medieval castles"],
    "geography and nature": ["rainforests", "deserts", "the Amazon river", "coral reefs", "mountains",
                             "the Arctic", "bees", "whales", "migrating birds", "trees in winter"],
    "language and writing": ["writing a cover letter", "writing a thank-you note", "improving vocabulary",
                             "common grammar mistakes", "writing a short story", "giving a speech",
                             "writing clear emails", "learning Spanish", "poetry", "keeping a journal"],
    "work and money": ["asking for a raise", "budgeting", "saving for retirement", "working from home",
                       "job interviews", "starting a small business", "negotiating", "credit scores",
                       "running a meeting", "giving feedback to a colleague"],
    "technology": ["how the internet works", "password security", "smartphone batteries",
                   "cloud storage", "artificial intelligence", "backing up files", "Wi-Fi problems",
                   "how GPS works", "electric cars", "3D printing"],
    "arts and culture": ["learning to draw", "jazz", "classical music", "photography", "film history",
                         "reading more books", "learning the piano", "museums", "theatre", "knitting"],
    "family and relationships": ["talking to teenagers", "bedtime routines for children", "pets and children",
                                 "long-distance friendships", "apologizing", "caring for elderly parents",
                                 "sibling rivalry", "wedding planning", "resolving arguments", "adopting a dog"],
    "hobbies and sports": ["gardening", "growing tomatoes", "chess", "football rules", "swimming",
                           "cycling", "bird watching", "board games", "fishing", "yoga"],
    "math and logic": ["fractions", "percentages", "probability", "prime numbers", "geometry of circles",
                       "mental arithmetic", "compound interest", "averages", "logic puzzles", "algebra basics"],
    "programming": ["recursion", "version control with git", "SQL joins", "unit testing",
                    "regular expressions", "object-oriented programming", "JavaScript promises",
                    "sorting algorithms", "REST APIs", "debugging"],
}

# A second, broader list (2026-12-08): the shipped draft accepted 0.632 of its first drafts on new tasks about
# training topics and 0.575 on the held-out topics (k = 1; 0.406 / 0.348 at k = 3), so a topic the draft has
# not seen costs acceptance, and users talk about everything. `--chat-topics more|all` trains on it; its
# held-out topics (the same crc32 rule) are kept out of training with the first list's, and evaluation
# stays on the first list's held-out topics, so figures compare across runs.
MORE_TOPICS: dict[str, list[str]] = {
    "everyday life": ["decluttering a closet", "grocery shopping lists", "ironing shirts", "fixing a squeaky door",
                      "getting up early", "hosting a dinner party", "living with roommates", "small talk",
                      "keeping houseplants alive", "organizing a desk", "writing a to-do list", "public transport etiquette",
                      "waiting in long queues", "lost luggage", "recycling at home", "buying a used car"],
    "food and cooking": ["making pancakes", "grilling vegetables", "homemade pizza dough", "storing leftovers",
                         "cooking pasta", "making salad dressing", "baking cookies", "sourdough starters",
                         "herbs and their uses", "cooking eggs", "tea varieties", "chocolate", "homemade jam",
                         "street food", "cooking for one person", "packing school lunches"],
    "health and fitness": ["sleep hygiene", "sunscreen", "warming up before exercise", "back pain", "allergies",
                           "eating more vegetables", "hiking fitness", "dental care", "eye strain from screens",
                           "first aid for cuts", "cutting down on sugar", "swimming technique", "cycling to work",
                           "resting after a workout", "seasonal flu shots", "mindful eating"],
    "travel": ["airport security", "hostels", "travelling alone", "visiting Paris", "learning to read maps",
               "souvenirs", "cruise holidays", "backpacking in South America", "long flights",
               "staying safe while travelling", "renting a car abroad", "visiting national parks",
               "taking pictures on holiday", "city breaks", "exchanging money abroad", "overnight buses"],
    "science": ["gravity", "sound waves", "the periodic table", "earthquakes", "bacteria and viruses",
                "the human heart", "the brain", "weather fronts", "ocean tides", "solar energy", "friction",
                "chemical reactions", "the greenhouse effect", "fossils", "the solar system", "static charge",
                "how vaccines work", "cells", "light and colour", "the nitrogen cycle"],
    "history": ["the Vikings", "the Great Wall of China", "the Aztecs", "the Cold War", "ancient Greece",
                "the invention of writing", "the Ottoman Empire", "the history of money", "the Wright brothers",
                "the abolition of slavery", "the Olympic Games in antiquity", "the Black Death", "the samurai",
                "the history of the bicycle", "the Mayan calendar", "the first computers"],
    "geography and nature": ["rivers and deltas", "glaciers", "islands", "savannas", "wetlands", "caves",
                             "the Sahara", "the Himalayas", "monsoons", "tides and coastlines", "wolves",
                             "butterflies", "octopuses", "mushrooms", "wildflowers", "owls"],
    "language and writing": ["writing a resume", "punctuation", "writing a book review", "persuasive essays",
                             "learning French", "idioms in English", "writing dialogue", "editing your own writing",
                             "sign language", "learning Mandarin", "writing a toast", "note-taking",
                             "storytelling", "writing a complaint letter", "reading aloud to children", "haiku"],
    "work and money": ["writing a business plan", "freelancing", "taxes for beginners", "credit cards",
                       "emergency funds", "changing careers", "public speaking at work", "dealing with a difficult boss",
                       "inflation", "index funds", "paying off debt", "networking events", "work-life balance",
                       "remote team communication", "salary negotiation", "renting versus buying a home"],
    "technology": ["email spam", "two-factor authentication", "computer viruses", "streaming services",
                   "smart home devices", "how search engines work", "social media privacy", "online shopping safety",
                   "video calls", "choosing a laptop", "solar panels", "robots", "virtual reality",
                   "how touchscreens work", "digital photos storage", "keyboard shortcuts"],
    "arts and culture": ["watercolour painting", "opera", "street art", "sculpture", "learning the guitar",
                         "writing songs", "dance styles", "comic books", "pottery", "architecture",
                         "folk tales", "calligraphy", "origami", "musicals", "podcasts", "poetry readings"],
    "family and relationships": ["planning a family holiday", "screen time for kids", "teaching children to save money",
                                 "grandparents", "first dates", "setting boundaries", "supporting a grieving friend",
                                 "twins", "potty training", "family game night", "making new neighbours welcome",
                                 "helping with homework", "blended families", "thank-you gifts for teachers",
                                 "celebrating anniversaries", "reconnecting with old friends"],
    "hobbies and sports": ["tennis", "basketball", "rock climbing", "skiing", "sewing", "woodworking",
                           "jigsaw puzzles", "stamp collecting", "running a marathon", "kayaking", "golf",
                           "baking as a hobby", "crossword puzzles", "model trains", "skateboarding", "table tennis"],
    "math and logic": ["ratios", "negative numbers", "the Pythagorean theorem", "statistics basics",
                       "multiplication tables", "decimals", "area and perimeter", "binary numbers",
                       "patterns in sequences", "estimating", "graphs and charts", "units of measurement"],
    "programming": ["Python lists", "linked lists", "hash tables", "HTML and CSS", "Docker containers",
                    "code reviews", "variables and types", "loops", "APIs and JSON", "binary search",
                    "command line basics", "functional programming", "memory leaks", "concurrency"],
    "animals and pets": ["cats", "training a puppy", "goldfish", "hamsters", "horses", "parrots", "elephants",
                         "penguins", "sharks", "ants", "frogs", "dolphins", "bats", "snakes", "tortoises", "foxes"],
    "space": ["Mars", "the International Space Station", "comets", "telescopes", "the Sun", "Jupiter",
              "astronauts", "satellites", "the Big Bang", "eclipses", "meteor showers", "exoplanets"],
    "home and DIY": ["painting a room", "unclogging a drain", "hanging shelves", "insulating a house",
                     "choosing paint colours", "basic plumbing", "building a birdhouse", "fixing a leaky tap",
                     "cleaning windows", "assembling flat-pack furniture", "tiling a bathroom", "composting"],
    "society and civics": ["voting", "how laws are made", "volunteering", "local government", "human rights",
                           "recycling programs", "public libraries", "jury duty", "charity donations",
                           "community gardens", "the United Nations", "freedom of the press"],
    "psychology and learning": ["motivation", "procrastination", "memory techniques", "habits", "confidence",
                                "learning a new skill", "dealing with failure", "curiosity", "focus and attention",
                                "emotional intelligence", "study techniques", "growth mindset"],
    "environment and weather": ["plastic pollution", "thunderstorms", "hurricanes", "snow", "air quality",
                                "endangered species", "wind power", "saving water", "deforestation",
                                "fog", "heat waves", "ocean conservation"],
}

TASKS = [
    "Explain {t} in simple terms.", "What are the most important things to know about {t}?",
    "Give me three practical tips about {t}.", "Explain {t} to a ten-year-old.",
    "What are common mistakes people make with {t}?", "Write a short paragraph about {t}.",
    "List five interesting facts about {t}.", "Summarize the main ideas of {t} in a few sentences.",
    "What is a common misconception about {t}?", "Write a short poem about {t}.",
    "How would you get started with {t}?", "What are the pros and cons of {t}?",
    "Write a short story for children that involves {t}.", "Why does {t} matter?",
    "Write a friendly message to a friend recommending {t}.", "Give me a step-by-step guide to {t}.",
]

REWRITES = ["Rewrite this sentence to sound more formal: {s}", "Make this sentence shorter: {s}",
            "Fix the grammar in this sentence: {s}", "Rewrite this in a cheerful tone: {s}",
            "Translate into French: {s}", "Translate into Spanish: {s}", "Translate into German: {s}"]
SENTENCES = ["i cant come to the meeting tomorrow because i am sick", "The weather was bad so we stayed home.",
             "Please send me the report by Friday.", "We had a great time at the beach last weekend.",
             "The train was late again this morning.", "Thank you for helping me move last week.",
             "Our team finished the project two days early.", "He forgot his keys and had to wait outside.",
             "The new cafe downtown makes excellent pastries.", "I would like to book a table for four."]

LANGUAGES = ["Python", "JavaScript", "Java", "C", "Go", "Rust", "SQL", "Bash"]
CODE_TASKS = ["reverses a string", "checks whether a number is prime", "counts the words in a text",
              "finds the largest number in a list", "computes the factorial of n", "removes duplicates from a list",
              "converts Celsius to Fahrenheit", "checks whether a word is a palindrome",
              "sums the even numbers in a list", "merges two sorted lists"]

FOLLOW_UPS = ["Can you make that shorter?", "Can you give me an example?", "Why is that?",
              "Can you explain that more simply?", "What else should I know?", "Thanks! Can you summarize it in one sentence?"]

INSTRUCT = ("Here are questions people asked about other topics:\n- How do I keep basil alive indoors?\n"
            "- Why do onions make you cry?\n- What is the best way to learn to swim as an adult?\n"
            "Write one similar question about {t}. Reply with the question only.")
PREFILL = 'Here is a question someone might ask about {t}: "'  # the answer's start: the question follows
_NOT_A_USER = re.compile(r"\b(assistant|AI|SmolLM|curious person|question|questions|I'm ready|help you)\b", re.I)


@dataclass(frozen=True)
class ChatItem:
    """One training or evaluation conversation: `messages` ends with the user turn to answer."""
    topic: str  # the split key
    kind: str  # "task" | "rewrite" | "math" | "code" | "self-instruct" | "follow-up"
    messages: tuple[dict, ...]


TOPIC_SETS = ("all", "base", "more")


def topic_lists(topic_set: str = "base") -> list[dict[str, list[str]]]:
    """The topic lists (domain -> topics) a topic set draws from: base = TOPICS, more = MORE_TOPICS."""
    return {"base": [TOPICS], "more": [MORE_TOPICS], "all": [TOPICS, MORE_TOPICS]}[topic_set]


def all_topics(topic_set: str = "base") -> list[str]:
    return [t for d in topic_lists(topic_set) for ts in d.values() for t in ts]


def _in_domain(topic: str, domain: str) -> bool:
    return any(topic in d.get(domain, ()) for d in topic_lists("all"))


def is_heldout_topic(topic: str, pct: int = 15) -> bool:
    return zlib.crc32(topic.encode()) % 100 < pct


def _user(topic: str, kind: str, text: str) -> ChatItem:
    return ChatItem(topic, kind, ({"role": "user", "content": text},))


def _math(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 40), rng.randint(2, 12), rng.randint(2, 9)
    item, person = rng.choice(["apples", "books", "stickers", "marbles", "cookies"]), rng.choice(
        ["Sam", "Maria", "Ken", "Aisha", "Leo"])
    return rng.choice([
        f"{person} has {a} {item} and buys {b} packs with {c} {item} each. How many {item} does {person} have now?",
        f"A train travels at {a + 30} km per hour for {b} hours. How far does it go?",
        f"A shirt costs ${a + 10} and is {c * 5}% off. What is the sale price?",
        f"{person} reads {b} pages a day. How many days to finish a book of {a * 10} pages?",
        f"There are {a} students and each table seats {c}. How many tables are needed?"])


def seed_prompts(topics: list[str], seed: int = 0) -> list[ChatItem]:
    """Topic x task prompts plus rewrites, math word problems and code requests (deterministic)."""
    rng = random.Random(seed)
    out = []
    for t in topics:
        for task in rng.sample(TASKS, 10):
            out.append(_user(t, "task", task.format(t=t)))
        if _in_domain(t, "math and logic"):
            out += [_user(t, "math", _math(rng)) for _ in range(4)]
        if _in_domain(t, "programming"):
            out += [_user(t, "code", f"Write a {rng.choice(LANGUAGES)} function that {rng.choice(CODE_TASKS)}.")
                    for _ in range(3)]
            out.append(_user(t, "code", f"Explain {t} with a short {rng.choice(LANGUAGES)} example."))
        for _ in range(1):
            out.append(_user(t, "rewrite", rng.choice(REWRITES).format(s=rng.choice(SENTENCES))))
    rng.shuffle(out)
    return out


_STOP_WORDS = {"with", "every", "enough", "about", "from", "into", "your", "their", "this", "that"}


def _stem(word: str) -> str:
    """A plural's or possessive's "s" dropped, then a final "e" where 4+ letters remain, so singular
    and plural meet ("volcano"/"volcanoes", "bee"/"bees", "phase"/"phases") and short words stay
    apart ("be" is no "bee", "not" no "note")."""
    w = word.removesuffix("s")
    return w[:-1] if w.endswith("e") and len(w) > 4 else w


def _words(text: str) -> set[str]:
    """Lower-case words, stemmed (`_stem`: "the moon's phases" -> moon, phas)."""
    return {_stem(w) for w in re.findall(r"[a-z]+", text.lower()) if len(w) > 1}


def topic_words(topic: str) -> set[str]:
    """The words that name a topic (4+ letters, not filler), stemmed as `_words` stems a text:
    all of them in a text = about it."""
    return {_stem(w) for w in re.findall(r"[a-z]+", topic.lower()) if len(w) >= 4 and w not in _STOP_WORDS}


def mentioned_topic(text: str, topics: list[str]) -> str | None:
    """The first of `topics` whose every naming word occurs in `text`, else None: a training
    prompt that names a held-out topic ("How do you make electricity ...?", written by
    self-instruct for "electric cars") would leak it into training."""
    words = _words(text)
    return next((t for t in topics if (tw := topic_words(t)) and tw <= words), None)


def user_text(tokenizer, ids: list[int]) -> str:
    """What the user wrote in a chat-template prompt (the user turns, joined by newlines; the
    whole decoded text without a template): an answer the target gave in an earlier turn may
    name any topic, the user's questions must not name a held-out one."""
    text = tokenizer.decode(ids, skip_special_tokens=False)
    try:
        probe = tokenizer.apply_chat_template([{"role": "user", "content": "\x01"}], tokenize=False)
    except Exception:  # noqa: BLE001 - no chat template
        return text
    before, after = probe.split("\x01", 1)
    end = after.split("\n")[0] or after  # the end-of-turn marker
    opening = (before[before.rfind(end) + len(end):] if end and end in before else before).lstrip("\n")
    turns = re.findall(re.escape(opening) + "(.*?)" + re.escape(end), text, flags=re.S) if opening and end else []
    return "\n".join(turns) if turns else text


def _stems(text: str) -> set[str]:
    return {w[:4] for w in re.findall(r"[a-z]+", text.lower()) if len(w) > 3}


def clean_question(text: str, topic: str, avoid: list[str] = ()) -> str | None:
    """The generated question if it reads as one user question about `topic` (one line, 4-40
    words, ending in '?', sharing a word with the topic, not talking about the assistant, naming
    none of the topics to `avoid`: the held-out ones), else None."""
    line = text.split('"')[0] if '"' in text else text  # after PREFILL the question ends at the quote
    line = line.strip().split("\n")[0].strip().lstrip("-*• ").strip()
    line = re.sub(r"^.{0,40}\bask(s|ed)?\b\s*[:,]\s*", "", line, flags=re.I)  # "A person might ask: ..."
    q = line.strip().strip("\"'“”").strip()
    if not q.endswith("?") or not 4 <= len(q.split()) <= 40 or _NOT_A_USER.search(q):
        return None
    return q if _stems(q) & _stems(topic) and not mentioned_topic(q, list(avoid)) else None


def self_instruct(model, tokenizer, topics: list[str], per_topic: int, path: Path, batch: int = 24,
                  seed: int = 0, max_attempts: int = 3, avoid: list[str] = ()) -> list[list[ChatItem]]:
    """Questions the target writes about each topic (sampled at T=0.8, deduplicated, filtered;
    none naming a topic to `avoid`),
    cached in `path` (jsonl: {"topic", "text", "attempt", "per_topic"}). A topic with fewer than
    `per_topic` questions, never asked for that many, is asked again with fresh seeds (at most
    `max_attempts` times), so raising `per_topic` on a resumed run adds questions and keeps the
    ones already answered. Returns the
    questions by attempt (a resumed run appends a new attempt's questions after the old ones)."""
    from tqdm import tqdm

    from specdec.prompts import encode_chat
    from specdec.sampling import SamplingParams
    from specdec_tools.distill.answers import append_jsonl, plain_engine, read_jsonl

    path = Path(path)
    cached = read_jsonl(path)
    have: dict[str, list[str]] = {t: [] for t in topics}
    attempts: dict[str, int] = {t: 0 for t in topics}
    asked: dict[str, int] = {t: 0 for t in topics}  # the most questions a topic was asked for
    for r in cached:
        if r["topic"] in have:
            attempts[r["topic"]] = max(attempts[r["topic"]], r.get("attempt", 0) + 1)
            asked[r["topic"]] = max(asked[r["topic"]], r.get("per_topic", 0))
            if r["text"]:
                have[r["topic"]].append(r["text"])
    todo = [t for t in topics if len(have[t]) < per_topic and asked[t] < per_topic and attempts[t] < max_attempts]
    if todo:
        prompt = {t: encode_chat(tokenizer, [{"role": "user", "content": INSTRUCT.format(t=t)}])
                  + tokenizer(PREFILL.format(t=t), add_special_tokens=False).input_ids for t in todo}
        engine = plain_engine(model, tokenizer, batch, max(len(p) for p in prompt.values()) + 64)
        tries = 2 * per_topic
        bar = tqdm(total=len(todo), desc="self-instruct", unit="topic", dynamic_ncols=True)
        with append_jsonl(path) as f:
            for c in range(0, len(todo), max(1, batch // tries)):
                chunk = todo[c: c + max(1, batch // tries)]
                jobs = [(t, j) for t in chunk for j in range(tries)]
                params = [SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95,
                                         seed=seed * 100_003 + zlib.crc32(t.encode()) + j + 1000 * attempts[t])
                          for t, j in jobs]
                seqs = engine.generate([prompt[t] for t, _ in jobs], params)
                kept: dict[str, list[str]] = {t: [] for t in chunk}
                for (t, _), s in zip(jobs, seqs):
                    q = clean_question(tokenizer.decode(s.output_ids, skip_special_tokens=True), t, avoid)
                    seen = {x.lower() for x in have[t] + kept[t]}
                    if q and q.lower() not in seen and len(have[t]) + len(kept[t]) < per_topic:
                        kept[t].append(q)
                for t in chunk:  # a topic with no usable question is still recorded as asked
                    rows = [{"topic": t, "text": q, "attempt": attempts[t], "per_topic": per_topic}
                            for q in kept[t]] or [{"topic": t, "text": None, "attempt": attempts[t], "per_topic": per_topic}]
                    f.write("".join(json.dumps(r) + "\n" for r in rows))
                    cached += rows
                f.flush()
                bar.update(len(chunk))
        bar.close()
    by_attempt: list[list[ChatItem]] = [[] for _ in range(max_attempts)]
    for r in cached:
        if r["text"] and r["topic"] in topics:
            by_attempt[r.get("attempt", 0)].append(_user(r["topic"], "self-instruct", r["text"]))
    return by_attempt


def follow_ups(items: list[ChatItem], answers: list[str], seed: int = 0) -> list[ChatItem]:
    """Second turns: each conversation with its answer and a follow-up question appended."""
    rng = random.Random(seed)
    return [ChatItem(it.topic, "follow-up", it.messages + ({"role": "assistant", "content": a},
                                                           {"role": "user", "content": rng.choice(FOLLOW_UPS)}))
            for it, a in zip(items, answers) if a.strip()]


def split_topics(heldout_pct: int = 15, topic_set: str = "base") -> tuple[list[str], list[str]]:
    """(training topics, held-out topics) of a topic set (`TOPIC_SETS`)."""
    ts = all_topics(topic_set)
    return [t for t in ts if not is_heldout_topic(t, heldout_pct)], [t for t in ts if is_heldout_topic(t, heldout_pct)]


def heldout_topics(heldout_pct: int = 15) -> list[str]:
    """Every held-out topic of every list: what no training prompt may name, whichever list a run draws from."""
    return split_topics(heldout_pct, "all")[1]

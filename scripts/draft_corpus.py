"""The prompt corpus the EAGLE draft is trained on (scripts/train_draft.py).

Written for this project, apart from the benchmark's workloads (edge_rtgi/bench/data): other
topics, other sentences, other code. It mirrors the workloads' *forms* (the daemon's system
prompt with one- and multi-turn chats, short voice commands, the translation instruction, raw
Python prefixes for completion), because a draft learns the target's habits in those forms.

``corpus(seed)`` returns the prompts as chat message lists or raw text, shuffled with ``seed``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

TOPICS = (
    "volcanoes",
    "the water cycle",
    "honey bees",
    "black holes",
    "the printing press",
    "compound interest",
    "sourdough bread",
    "electric cars",
    "the Roman Empire",
    "photosynthesis",
    "jet lag",
    "solar panels",
    "the Great Barrier Reef",
    "chess openings",
    "the immune system",
    "earthquakes",
    "coffee roasting",
    "the stock market",
    "rainbows",
    "the human heart",
    "recycling plastic",
    "the Moon landing",
    "tides",
    "vaccines",
    "glaciers",
    "the internet",
    "octopuses",
    "wind turbines",
    "the Renaissance",
    "sleep cycles",
    "credit scores",
    "composting",
    "the Amazon rainforest",
    "lightning",
    "hybrid cars",
    "the Silk Road",
    "meditation",
    "penguins",
    "3D printing",
    "the French Revolution",
    "dinosaurs",
    "tea ceremonies",
    "hurricanes",
    "the periodic table",
    "bicycles",
    "the Olympic Games",
    "coral bleaching",
    "yoga",
    "quantum computers",
    "the Pyramids of Giza",
    "bird migration",
    "inflation",
    "vitamin D",
    "batteries",
    "the Northern Lights",
    "jazz music",
    "cryptography",
    "the Eiffel Tower",
    "sharks",
    "public libraries",
    "camping",
    "rice farming",
    "the speed of light",
    "origami",
    "sunscreen",
    "the Great Wall of China",
    "submarines",
    "bread yeast",
    "time zones",
    "the metric system",
    "elephants",
    "wildfires",
    "hot air balloons",
    "the violin",
    "satellites",
    "deserts",
    "mushrooms",
    "the Vikings",
    "marathons",
    "noise-cancelling headphones",
    "the ozone layer",
    "bamboo",
    "video game design",
    "the Mars rovers",
    "owls",
    "minimalism",
    "the Panama Canal",
    "tornadoes",
    "kites",
    "fermentation",
    "the blues",
    "electric guitars",
    "lighthouses",
    "wolves",
    "the Arctic",
    "cheese making",
    "budget travel",
    "home insulation",
    "the Nile river",
    "first aid",
    "houseplants",
    "password managers",
    "carbon dating",
)

QUESTION_FORMS = (
    "What is {t}?",
    "Can you explain {t} in simple terms?",
    "Tell me one interesting fact about {t}.",
    "Why does {t} matter?",
    "How does {t} work?",
    "Give me a short summary of {t}.",
    "What should a beginner know about {t}?",
    "What is the history of {t}?",
    "Is {t} good or bad for the environment?",
    "What are common myths about {t}?",
    "How would you explain {t} to a child?",
    "What is the most surprising thing about {t}?",
)

FOLLOW_UPS = (
    "Can you say more about that?",
    "Why is that?",
    "Give me an example.",
    "How long has that been known?",
    "Is that true everywhere?",
    "What would you recommend then?",
    "Thanks. And what about the costs?",
    "Can you make that shorter?",
    "Who discovered that?",
    "What is the next step?",
)

COMMANDS = (
    "set a timer for {n} minutes",
    "remind me to {task} at {h} o'clock",
    "what time is it in {city}",
    "add {item} to my shopping list",
    "play some {genre} music",
    "turn off the lights in the {room}",
    "how far is {city} from here",
    "what's {a} times {b}",
    "convert {n} miles to kilometres",
    "spell the word {word}",
    "what's a good name for a {pet}",
    "wake me up at {h} tomorrow",
    "how do you say thank you in {lang}",
    "read me a short poem about {t}",
    "call my {relative}",
    "what should I cook with {item} and {item2}",
    "how many days until {month}",
)
TASKS = ("water the plants", "call the dentist", "take out the bins", "buy stamps", "pay the rent", "stretch")
CITIES = ("Tokyo", "Nairobi", "Lima", "Oslo", "Toronto", "Jakarta", "Cairo", "Madrid", "Sydney", "Denver")
ITEMS = ("oat milk", "lemons", "rice", "spinach", "eggs", "coffee beans", "tomatoes", "garlic", "yoghurt")
GENRES = ("jazz", "classical", "reggae", "folk", "lo-fi", "rock", "ambient")
ROOMS = ("kitchen", "bedroom", "hallway", "garage", "living room", "bathroom")
WORDS = ("necessary", "rhythm", "colonel", "queue", "Wednesday", "definitely")
PETS = ("cat", "puppy", "goldfish", "parrot", "hamster")
LANGS = ("Japanese", "Swahili", "Italian", "Korean", "Portuguese", "Dutch")
RELATIVES = ("sister", "brother", "mother", "father", "aunt")
MONTHS = ("March", "July", "October", "December")

SENTENCES = (
    "The museum opens at ten in the morning.",
    "My brother lives near the river.",
    "Could you bring me a glass of water, please?",
    "We missed the last bus home.",
    "The children are playing in the garden.",
    "I would like to book a table for four.",
    "It has been raining since Tuesday.",
    "Please turn left at the next corner.",
    "Her new job starts on Monday.",
    "The soup is too hot to eat.",
    "They painted the kitchen yellow.",
    "How much does this jacket cost?",
    "The meeting was moved to Friday afternoon.",
    "I forgot my umbrella at the office.",
    "Our flight lands at half past six.",
    "The library closes early on Sundays.",
    "He reads the newspaper every morning.",
    "Is there a pharmacy open tonight?",
    "The cat is sleeping on the sofa.",
    "We need more chairs for the party.",
    "My phone battery is almost empty.",
    "The concert tickets sold out in an hour.",
    "She speaks three languages fluently.",
    "Can I pay by card?",
    "The bridge is closed for repairs.",
    "I am learning to play the piano.",
    "The bakery on the corner sells fresh bread.",
    "Do you know where the post office is?",
    "Winter in the mountains is very cold.",
    "They are planning a trip to the coast.",
)
TARGET_LANGS = ("Spanish", "French", "German", "Italian")

CODE_STUBS = (
    ("def is_palindrome(text):", "Return True if text reads the same backwards, ignoring case and spaces."),
    ("def word_count(path):", "Count the words in the text file at path."),
    ("def merge_sorted(a, b):", "Merge two sorted lists into one sorted list."),
    ("def celsius_to_fahrenheit(c):", "Convert a temperature from Celsius to Fahrenheit."),
    ("def flatten(nested):", "Flatten a list of lists into a single list."),
    ("def chunk(items, size):", "Split items into lists of at most size elements."),
    ("def gcd(a, b):", "Return the greatest common divisor of a and b."),
    ("def read_json(path):", "Load and return the JSON document stored at path."),
    ("def unique(items):", "Return the items without duplicates, keeping their first order."),
    ("def median(values):", "Return the median of a non-empty list of numbers."),
    ("def capitalize_words(sentence):", "Capitalise the first letter of every word in sentence."),
    ("def count_vowels(text):", "Return how many vowels text contains."),
    ("def transpose(matrix):", "Return the transpose of a matrix given as a list of rows."),
    ("def binary_search(items, target):", "Return the index of target in the sorted list items, or -1."),
    ("def running_total(values):", "Return the cumulative sums of values."),
    ("def parse_date(text):", "Parse a date written as YYYY-MM-DD and return a datetime.date."),
    ("def top_k(counts, k):", "Return the k keys of counts with the largest values."),
    ("def rotate(items, n):", "Rotate the list items to the right by n places."),
    ("def is_prime(n):", "Return True if n is a prime number."),
    ("def dedent_lines(lines):", "Remove the common leading whitespace from a list of lines."),
    ("def safe_divide(a, b):", "Divide a by b, returning None when b is zero."),
    ("def histogram(values, bins):", "Count how many values fall into each of bins equal-width bins."),
    ("def slugify(title):", "Turn a title into a lowercase URL slug with hyphens."),
    ("def pairwise(items):", "Return consecutive pairs (items[i], items[i + 1])."),
    ("def levenshtein(a, b):", "Return the edit distance between strings a and b."),
    ("def group_by(items, key):", "Group items into a dict of lists by key(item)."),
    ("def moving_average(values, window):", "Return the moving averages of values over window items."),
    ("def reverse_words(sentence):", "Reverse the order of the words in sentence."),
    ("def to_roman(number):", "Convert a positive integer to Roman numerals."),
    ("def matrix_multiply(a, b):", "Multiply two matrices given as lists of rows."),
    ("def count_lines(path):", "Return the number of lines in the file at path."),
    ("def normalize(values):", "Scale values linearly so that they span 0 to 1."),
    ("def is_anagram(a, b):", "Return True if a and b are anagrams of each other."),
    ("def fizzbuzz(n):", "Return the FizzBuzz strings for 1 to n."),
    ("def sum_digits(n):", "Return the sum of the decimal digits of n."),
    ("def invert_dict(mapping):", "Swap the keys and values of mapping."),
    ("def validate_email(address):", "Return True if address looks like a valid e-mail address."),
    ("def find_duplicates(items):", "Return the items that appear more than once."),
    ("def hex_to_rgb(color):", "Convert a colour like '#ff8800' to an (r, g, b) tuple."),
    ("def power_set(items):", "Return all subsets of items as lists."),
)
CODE_CLASSES = (
    ("class Stack:", "A last-in, first-out stack with push, pop and peek."),
    ("class Counter:", "Counts how often each key was added."),
    ("class LRUCache:", "A fixed-size cache that evicts the least recently used key."),
    ("class BankAccount:", "A bank account with deposit, withdraw and balance."),
    ("class Timer:", "A context manager that measures elapsed wall-clock time."),
    ("class Queue:", "A first-in, first-out queue built on two lists."),
    ("class Vector2:", "A 2-D vector with addition, scaling and length."),
    ("class TodoList:", "A list of tasks that can be added, completed and listed."),
)


@dataclass(frozen=True)
class CorpusPrompt:
    """One training prompt: chat ``messages`` or raw ``text``, and the form it stands for."""

    form: str  # dialogue | voice | translation | code
    messages: tuple[tuple[str, str], ...] = ()  # (role, content)
    text: str = ""
    max_tokens: int = 128


def _fill(form: str, rng: random.Random) -> str:
    return form.format(
        t=rng.choice(TOPICS),
        n=rng.randint(2, 45),
        task=rng.choice(TASKS),
        h=rng.randint(1, 12),
        city=rng.choice(CITIES),
        item=rng.choice(ITEMS),
        item2=rng.choice(ITEMS),
        genre=rng.choice(GENRES),
        room=rng.choice(ROOMS),
        a=rng.randint(3, 19),
        b=rng.randint(3, 19),
        word=rng.choice(WORDS),
        pet=rng.choice(PETS),
        lang=rng.choice(LANGS),
        relative=rng.choice(RELATIVES),
        month=rng.choice(MONTHS),
    )


def corpus(system_prompt: str, seed: int = 0) -> list[CorpusPrompt]:
    """Every prompt of the corpus, shuffled with ``seed``. ``system_prompt``: the daemon's own."""
    rng = random.Random(seed)
    out: list[CorpusPrompt] = []
    for topic in TOPICS:
        for form in QUESTION_FORMS:
            question = form.format(t=topic)
            if rng.random() < 0.5:
                out.append(CorpusPrompt("dialogue", (("system", system_prompt), ("user", question))))
            else:  # no system prompt: the model's own habits when nobody restrains it
                out.append(CorpusPrompt("dialogue", (("user", question),)))
        # a two-turn chat, the first answer written here, so the model continues a conversation
        question = rng.choice(QUESTION_FORMS).format(t=topic)
        first = (
            f"{topic[0].upper()}{topic[1:]} is a broad subject; the short answer depends on what you mean."
        )
        out.append(
            CorpusPrompt(
                "dialogue",
                (
                    ("system", system_prompt),
                    ("user", question),
                    ("assistant", first),
                    ("user", rng.choice(FOLLOW_UPS)),
                ),
            )
        )
    voice_system = system_prompt + " Answer in one short sentence."
    for _ in range(700):
        command = _fill(rng.choice(COMMANDS), rng)
        out.append(CorpusPrompt("voice", (("system", voice_system), ("user", command)), max_tokens=64))
    for sentence in SENTENCES:
        for lang in TARGET_LANGS:
            system = (
                f"You translate English into {lang}. Reply with the {lang} translation of the "
                "user's text only, with no notes or explanations."
            )
            out.append(CorpusPrompt("translation", (("system", system), ("user", sentence)), max_tokens=64))
    for signature, doc in CODE_STUBS + CODE_CLASSES:
        out.append(CorpusPrompt("code", text=f'{signature}\n    """{doc}"""\n', max_tokens=128))
        out.append(CorpusPrompt("code", text=f"# {doc}\n{signature}\n", max_tokens=128))
    rng.shuffle(out)
    return out

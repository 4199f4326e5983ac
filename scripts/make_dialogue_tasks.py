#!/usr/bin/env python3
"""Build ``edge_rtgi/bench/data/tasks/dialogue.jsonl``: conversations that test recall of a fact.

Each conversation is some small-talk exchanges, one exchange in which the user states a fact (a
name, a number, a place or a time), more small talk, and a last user turn asking for that fact.
The fact sits ``distance`` exchanges before the question (1, 4, 12 or 30; an exchange is one user
turn and the assistant's reply), after 0-2 opening exchanges. Every exchange, fact template and
value below was written for this project. The output is fixed by ``--seed``; the committed
file was made with the default seed:

    python scripts/make_dialogue_tasks.py                 # writes the shipped file
    python scripts/make_dialogue_tasks.py --out /tmp/d.jsonl --per-distance 40

The assistant's reply to the fact confirms it ("Noted, room 612."), as a voice assistant would.
Checks while building: no filler exchange is used twice in one conversation, and no accepted
answer (normalised as the scorer normalises it) appears in the conversation's filler or in the
question, so only the fact exchange can supply it.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from edge_rtgi.bench.tasks import DIALOGUE_DISTANCES, TASKS_DIR, contains_answer

# (user, assistant): small talk and everyday help, in the assistant's short spoken style.
FILLER: tuple[tuple[str, str], ...] = (
    (
        "Any tips for keeping basil alive on a windowsill?",
        "Give it plenty of sun, water it when the top of the soil feels dry, and pinch off any flower buds.",
    ),
    (
        "What's a quick breakfast I can make without cooking?",
        "Overnight oats are easy: mix oats with milk or yoghurt before bed and add fruit in the morning.",
    ),
    (
        "How do I get a coffee stain out of a white shirt?",
        "Rinse it with cold water from the back of the stain, then rub in a little dish soap before washing.",
    ),
    (
        "Is it better to stretch before or after a run?",
        "A short, gentle warm-up before is best, and save the longer stretches for after the run.",
    ),
    (
        "My phone battery drains really fast lately.",
        "Try lowering the screen brightness and checking which apps use the most battery in your settings.",
    ),
    (
        "Can you suggest a board game for a family evening?",
        "Ticket to Ride is a good choice: easy to learn, and both children and adults enjoy it.",
    ),
    (
        "What's the difference between baking soda and baking powder?",
        "Baking powder already contains an acid, while baking soda needs an acidic ingredient to work.",
    ),
    (
        "I can't decide what to watch tonight.",
        "If you want something light, a comedy you have seen before is a safe and relaxing pick.",
    ),
    (
        "How often should I water a cactus?",
        "Only when the soil is completely dry, which is usually every few weeks, and even less in winter.",
    ),
    (
        "Do you have a tip for remembering people's names?",
        "Say the name back when you are introduced and use it once more in the conversation.",
    ),
    (
        "Why does bread go stale so quickly?",
        "The starch slowly crystallises and the bread dries out, so keep it in a bag at room temperature.",
    ),
    (
        "What's a good way to start journaling?",
        "Write a few lines each evening about what happened and how you felt; keep it short and regular.",
    ),
    (
        "Should I wash new clothes before wearing them?",
        "Yes, it is a good idea, because it removes extra dye and any finishing chemicals from the factory.",
    ),
    (
        "How can I make my room feel less cluttered?",
        "Clear the flat surfaces first, then give every item a home so things go back to the same place.",
    ),
    (
        "Is it okay to leave my laptop plugged in all the time?",
        "Most modern laptops handle it fine, and many can limit charging to protect the battery.",
    ),
    (
        "What's an easy vegetable to grow for a beginner?",
        "Radishes are very forgiving and grow quickly, so you see results within a few weeks.",
    ),
    (
        "I keep forgetting to drink water during the day.",
        "Keep a bottle on your desk where you can see it and take a sip each time you check your messages.",
    ),
    (
        "How do I stop my glasses from fogging up?",
        "Rub a drop of dish soap on the lenses and gently wipe it off; the thin film stops fogging.",
    ),
    (
        "What should I bring on a day hike?",
        "Water, a snack, a light jacket, sun cream and a charged phone are the essentials.",
    ),
    (
        "Can you recommend a relaxing hobby?",
        "Sketching is calming and cheap to start: a pencil and a small notebook are all you need.",
    ),
    (
        "How long should I let steak rest after cooking?",
        "About five minutes for a thin steak and a little longer for a thick one, so the juices settle.",
    ),
    (
        "My cat keeps scratching the sofa.",
        "Put a scratching post right next to the sofa and reward her when she uses it instead.",
    ),
    (
        "Is it worth learning to touch type?",
        "Yes, a few weeks of short daily practice usually makes typing faster and less tiring.",
    ),
    (
        "What's a nice gesture for a neighbour who helped me?",
        "A handwritten note with some homemade biscuits or a small plant is always appreciated.",
    ),
    (
        "How do I keep cut flowers fresh for longer?",
        "Trim the stems at an angle, change the water every couple of days, and keep them away from fruit.",
    ),
    (
        "I feel sleepy every afternoon after lunch.",
        "A lighter lunch, a short walk outside and a glass of water often help with the afternoon dip.",
    ),
    (
        "What's the best way to learn a new language?",
        "Little and often works best: a short lesson every day plus listening to podcasts or songs.",
    ),
    (
        "How do I clean a cast iron pan?",
        "Wipe it with hot water and a brush, dry it on the hob, then rub in a thin layer of oil.",
    ),
    (
        "Do you think it will be a busy weekend for me?",
        "I cannot see your calendar, but if you tell me your plans I can help you sort them out.",
    ),
    (
        "What's a good stretch for a stiff neck?",
        "Slowly tilt your ear towards your shoulder, hold for a few breaths, and then switch sides.",
    ),
    (
        "How do I make rice less sticky?",
        "Rinse the rice in cold water until the water runs clear before you cook it.",
    ),
    (
        "Any idea how to keep a conversation going with someone shy?",
        "Ask open questions about things they enjoy, and be comfortable with a short pause now and then.",
    ),
    (
        "Why do onions make my eyes water?",
        "Cutting them releases a gas that irritates your eyes; a sharp knife and a cold onion help a lot.",
    ),
    (
        "What can I do with overripe bananas?",
        "They are perfect for banana bread or pancakes, or you can freeze them for smoothies.",
    ),
    (
        "How do I fix a squeaky door?",
        "A little oil or silicone spray on the hinges usually stops the squeak right away.",
    ),
    (
        "Is tea or coffee better in the morning?",
        "Both are fine; tea has less caffeine, so it gives a gentler start to the day.",
    ),
    (
        "How can I be more productive working from home?",
        "Keep a set start time, work in one spot, and take a proper break away from the screen at lunch.",
    ),
    (
        "What's a fun thing to do on a rainy day?",
        "Bake something new, start a jigsaw puzzle, or visit a museum if there is one nearby.",
    ),
    (
        "I never know how much to tip at restaurants.",
        "It depends on the country, so it is worth checking the local custom before you go out.",
    ),
    (
        "How do I stop my headphones cable from tangling?",
        "Loosely loop it around your fingers and secure it with a small clip or a hair tie.",
    ),
    (
        "Can you help me think of a name for my plant?",
        "How about something cheerful like Sunny or Sprout? Named plants get watered more, or so they say.",
    ),
    (
        "What's a simple way to save a bit more money?",
        "Move a small amount into savings on payday, before you have a chance to spend it.",
    ),
    (
        "Should I get a standing desk?",
        "It can help, but changing position often matters more than standing all day.",
    ),
    (
        "How do I get my dog to stop pulling on the lead?",
        "Stop walking whenever the lead goes tight and only move on when it is loose again.",
    ),
    (
        "What's the best way to pack a suitcase?",
        "Roll your clothes instead of folding them, and put shoes and heavy things near the wheels.",
    ),
    (
        "How do I know if an egg is still fresh?",
        "Put it in a bowl of water: a fresh egg sinks and lies flat, an old one stands up or floats.",
    ),
    (
        "My houseplant has yellow leaves.",
        "That often means too much water, so let the soil dry out more between waterings.",
    ),
    (
        "Is it bad to check my phone right before bed?",
        "The bright screen can make it harder to fall asleep, so try putting it away a little earlier.",
    ),
    (
        "How do I make a good cup of tea?",
        "Use freshly boiled water, let it brew for a few minutes, and add milk after, if you take it.",
    ),
    (
        "What's a good present for someone who likes cooking?",
        "A nice wooden spoon set, a good spice mix or a cookbook from a cuisine they love.",
    ),
    (
        "How can I get better at public speaking?",
        "Practise out loud a few times, slow down, and focus on one friendly face in the audience.",
    ),
    (
        "Why is my bread dough not rising?",
        "The yeast may be old or the room too cold; try a warmer spot and give it more time.",
    ),
    (
        "What should I do if I can't sleep?",
        "Get up for a few minutes, do something calm in dim light, and go back to bed when you feel drowsy.",
    ),
    (
        "How do I remove a splinter?",
        "Wash the area, then use clean tweezers to pull it out in the same direction it went in.",
    ),
    (
        "Any ideas for a quick healthy snack?",
        "Apple slices with peanut butter, a handful of nuts or some carrot sticks with hummus.",
    ),
    (
        "How can I keep my kitchen knives sharp?",
        "Use a honing steel before each use and a proper sharpener every few months.",
    ),
    (
        "What's the best time of day to exercise?",
        "Whenever you can stick to it; a regular routine matters more than the exact time.",
    ),
    (
        "I spilled red wine on the carpet.",
        "Blot it right away with a cloth, then dab on cold water and a little salt or dish soap.",
    ),
    (
        "Should I fold or hang my jumpers?",
        "Fold them, because hanging knitwear can stretch the shoulders out of shape.",
    ),
    (
        "How can I make my mornings less rushed?",
        "Lay out your clothes and pack your bag the night before, so the morning has fewer decisions.",
    ),
    (
        "What's a good way to unwind after work?",
        "A short walk, some music, or cooking a simple meal can help you switch off.",
    ),
    (
        "Do plants really like being talked to?",
        "There is little proof, but the extra attention usually means they get better care.",
    ),
    (
        "How do I descale a kettle?",
        "Boil a mix of water and vinegar or lemon juice, leave it to sit, then rinse it well.",
    ),
    (
        "Why does my laptop get so hot?",
        "The vents may be blocked or dusty; use it on a hard surface and clean the vents gently.",
    ),
    (
        "What's a polite way to decline an invitation?",
        "Thank them warmly, say you cannot make it this time, and suggest another time if you mean it.",
    ),
    (
        "How can I stop procrastinating?",
        "Start with just a few minutes on the task; getting started is usually the hardest part.",
    ),
    (
        "Is it safe to refreeze thawed meat?",
        "It is safe if it thawed in the fridge, though the texture may suffer a little.",
    ),
    (
        "How do I keep my car from smelling musty?",
        "Air it out on dry days, check the floor mats for damp, and leave a small bag of baking soda inside.",
    ),
    (
        "Can you suggest a dessert that is easy to make?",
        "A simple fruit crumble is hard to get wrong and works with apples, berries or rhubarb.",
    ),
    (
        "What's the point of a password manager?",
        "It remembers a strong, different password for every site, so you only need to remember one.",
    ),
    (
        "How do I soften hard brown sugar?",
        "Put it in a sealed container with a slice of bread overnight and it will soften again.",
    ),
    (
        "My feet hurt after a long day of walking.",
        "Soak them in warm water, put them up for a while, and think about shoes with better support.",
    ),
    (
        "Any tips for a first job interview?",
        "Research the company, prepare a couple of examples of your work, and have a question ready.",
    ),
    (
        "How can I make a small balcony nicer?",
        "A couple of potted plants, a small folding chair and some string lights go a long way.",
    ),
    (
        "What's a good way to wake up without an alarm?",
        "Keep the same bedtime every night and let daylight into the room in the morning.",
    ),
    (
        "Should I rinse pasta after cooking it?",
        "Not for hot dishes, because the starch helps the sauce stick; rinsing is only for pasta salads.",
    ),
    (
        "How do I get rid of fruit flies?",
        "Set a small dish of vinegar with a drop of dish soap near the fruit bowl, and take out the bin.",
    ),
    (
        "What's a good habit to start this month?",
        "A short walk after dinner is easy to keep and good for both mood and digestion.",
    ),
    (
        "How can I make my coffee taste less bitter?",
        "Use slightly cooler water, a coarser grind, or a pinch of salt in the grounds.",
    ),
    (
        "Is it worth fixing an old bicycle?",
        "Often yes; new brakes, tyres and a chain can make an old bike feel almost new.",
    ),
    (
        "How do I help a friend who is feeling down?",
        "Listen more than you talk, check in regularly, and offer to do something simple together.",
    ),
    (
        "What's a nice way to spend a quiet Sunday?",
        "A slow breakfast, a walk in the park and a good book make for a restful day.",
    ),
    (
        "How do I stop my shower curtain getting mouldy?",
        "Leave it spread out after showering so it dries, and wash it now and then with a little bleach.",
    ),
    (
        "Why do my eyes feel tired at the computer?",
        "Every so often, look at something far away for a few seconds, and remember to blink.",
    ),
    (
        "What's a good way to use leftover rice?",
        "Fried rice is the classic: fry it with an egg, some vegetables and a splash of soy sauce.",
    ),
    (
        "How can I keep my lunch cold without a fridge?",
        "Pack it in an insulated bag with a frozen water bottle, which doubles as a drink later.",
    ),
    (
        "Is it rude to text instead of calling?",
        "Not these days, but for serious news or a birthday a call still means more.",
    ),
    (
        "How do I iron a shirt quickly?",
        "Start with the collar, then the cuffs and sleeves, and finish with the front and back.",
    ),
    (
        "What can I do about a noisy neighbour?",
        "A friendly, calm chat usually works better than a note, and pick a moment when you are not annoyed.",
    ),
    (
        "How do I make my own salad dressing?",
        "Whisk three parts oil to one part vinegar with a little mustard, salt and pepper.",
    ),
    (
        "My umbrella keeps flipping inside out.",
        "Hold it into the wind rather than away from it, or look for a vented umbrella.",
    ),
    (
        "What's a cheap way to warm up a cold room?",
        "Close the curtains at dusk, block draughts under the door, and put down a rug.",
    ),
    (
        "How do I remember to take my vitamins?",
        "Keep them next to something you use every morning, like the kettle or your toothbrush.",
    ),
    (
        "Is it better to shower in the morning or at night?",
        "Either is fine; a morning shower wakes you up, while an evening one can help you relax.",
    ),
    (
        "How can I keep my desk tidy?",
        "Spend a minute clearing it at the end of each day, and keep only what you use often within reach.",
    ),
    (
        "Any tips for a long car journey?",
        "Take a break every couple of hours, keep snacks and water handy, and download some podcasts.",
    ),
    (
        "How do I make my sourdough more sour?",
        "A longer, cooler rise, for example overnight in the fridge, gives a tangier flavour.",
    ),
    (
        "What's a good way to say thank you to a teacher?",
        "A short card saying what you appreciated about their teaching means a lot to them.",
    ),
    (
        "Why do I get hiccups?",
        "Often from eating too fast or a fizzy drink; they usually stop on their own within minutes.",
    ),
    (
        "How can I make my wardrobe smell fresh?",
        "Leave a bar of soap or a small bag of dried lavender on a shelf, and keep it from being too full.",
    ),
)


@dataclass(frozen=True)
class FactTemplate:
    """One kind of fact: how the user states it, how the assistant answers, how it is asked for."""

    kind: str  # name, number, place or time
    statement: str  # with {value}
    acknowledgement: str  # with {value}: the assistant confirms what it heard
    questions: tuple[str, ...]
    values: tuple[tuple[str, tuple[str, ...]], ...]  # (value as stated, accepted answers)


def _plain(*values: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    return tuple((v, (v,)) for v in values)


def _time(display: str, *aliases: str) -> tuple[str, tuple[str, ...]]:
    return display, (display, *aliases)


TIMES = (
    _time("4:15", "four fifteen", "quarter past four", "16:15"),
    _time("7:40", "seven forty", "twenty to eight", "19:40"),
    _time("9:30", "nine thirty", "half past nine", "21:30"),
    _time("11:45", "eleven forty five", "quarter to twelve"),
    _time("2:20", "two twenty", "twenty past two", "14:20"),
    _time("6:50", "six fifty", "ten to seven", "18:50"),
    _time("8:25", "eight twenty five", "twenty five past eight", "20:25"),
    _time("3:35", "three thirty five", "twenty five to four", "15:35"),
    _time("10:10", "ten ten", "ten past ten", "22:10"),
    _time("5:55", "five fifty five", "five to six", "17:55"),
)

FACTS: tuple[FactTemplate, ...] = (
    FactTemplate(
        "name",
        "We adopted a puppy last weekend and named her {value}.",
        "Congratulations on the new puppy! {value} is a lovely name for her.",
        ("What did I say we named our new puppy?", "Remind me, what is my puppy called?"),
        _plain("Biscuit", "Juniper", "Waffles", "Mochi", "Clementine", "Pickles", "Nugget", "Marzipan"),
    ),
    FactTemplate(
        "name",
        "My new manager at work is called {value}.",
        "I hope you and {value} get on well. A good manager makes a big difference.",
        ("What is my new manager called?", "Sorry, what did I say my manager's name was?"),
        _plain("Imogen", "Tobias", "Priya", "Leopold", "Ingrid", "Rafael", "Beatrix", "Oswald"),
    ),
    FactTemplate(
        "name",
        "I'm meeting my old school friend {value} for lunch on Friday.",
        "Lunch with {value} sounds lovely. It is always nice to catch up with old friends.",
        ("Who am I meeting for lunch on Friday?", "What was the name of the friend I'm having lunch with?"),
        _plain("Desmond", "Henrietta", "Caspian", "Ottilie", "Lorcan", "Yusuf", "Marisol", "Thaddeus"),
    ),
    FactTemplate(
        "name",
        "My new doctor is Doctor {value}, and she seems very kind.",
        "Good to hear that Doctor {value} is kind. A doctor you trust makes appointments easier.",
        ("What is my new doctor's name?", "Can you remind me what my doctor is called?"),
        _plain(
            "Okafor", "Lindqvist", "Castellano", "Whitlock", "Nakamura", "Abernathy", "Ferreira", "Kowalczyk"
        ),
    ),
    FactTemplate(
        "number",
        "For the record, my hotel room number is {value}.",
        "Noted, room {value}. I will keep that in mind for you.",
        ("What was my hotel room number again?", "Which room am I staying in at the hotel?"),
        _plain("214", "378", "509", "612", "731", "846", "927", "453"),
    ),
    FactTemplate(
        "number",
        "My locker at the gym is number {value}.",
        "Got it, locker {value}. That saves wandering around the changing room.",
        ("What number is my gym locker?", "Which locker did I say is mine at the gym?"),
        _plain("37", "58", "64", "83", "91", "46", "72", "29"),
    ),
    FactTemplate(
        "number",
        "I take the number {value} bus to get to work.",
        "The {value} bus, got it. Buses are a relaxing way to commute if you can read on the way.",
        ("Which bus do I take to work?", "What number was the bus I take to work?"),
        _plain("73", "118", "246", "52", "167", "39", "284", "95"),
    ),
    FactTemplate(
        "number",
        "I parked the car in space {value} on the top floor.",
        "Space {value}, noted. Big car parks can be confusing.",
        ("Which space did I park the car in?", "What was the number of my parking space?"),
        _plain("143", "87", "265", "319", "76", "198", "432", "61"),
    ),
    FactTemplate(
        "place",
        "My sister just moved to {value} for a new job.",
        "Moving to {value} is a big change for her. I hope she enjoys living there.",
        ("Which city did my sister move to?", "Where did I say my sister moved for her job?"),
        (
            *_plain("Lisbon", "Montreal", "Edinburgh", "Seville", "Bergen", "Tallinn", "Adelaide"),
            ("Krakow", ("Krakow", "Cracow")),
        ),
    ),
    FactTemplate(
        "place",
        "My grandmother grew up in a small village called {value}.",
        "{value} sounds charming. Villages often have such interesting histories.",
        ("What was the name of my grandmother's village?", "Where did my grandmother grow up?"),
        _plain(
            "Brackenfold", "Wenlow", "Ashcombe", "Kirkwell", "Pennick", "Thornbury", "Elsmere", "Hollowmere"
        ),
    ),
    FactTemplate(
        "place",
        "My cousin's wedding is going to be in {value} this summer.",
        "How exciting. A summer wedding in {value} sounds wonderful.",
        ("Where is my cousin's wedding?", "In which city is my cousin getting married?"),
        (
            *_plain("Vienna", "Dubrovnik", "Galway", "Porto", "Ljubljana", "Kyoto", "Valparaiso"),
            ("Marrakesh", ("Marrakesh", "Marrakech")),
        ),
    ),
    FactTemplate(
        "place",
        "We booked our holiday cottage in {value} for next month.",
        "Lovely. A cottage in {value} is a great way to switch off.",
        ("Where is our holiday cottage?", "Where did I say we booked the holiday cottage?"),
        _plain("Cornwall", "Connemara", "Normandy", "Tuscany", "Snowdonia", "Provence", "Brittany", "Umbria"),
    ),
    FactTemplate(
        "time",
        "My dentist appointment tomorrow is at {value}.",
        "Got it, the dentist at {value}. I hope it is just a quick check-up.",
        ("What time is my dentist appointment?", "When did I say my dentist appointment is?"),
        TIMES,
    ),
    FactTemplate(
        "time",
        "My train to the coast leaves at {value} on Saturday.",
        "The {value} train to the coast, noted. I hope the weather is kind to you.",
        ("What time does my train leave on Saturday?", "When is my train to the coast?"),
        TIMES,
    ),
    FactTemplate(
        "time",
        "The parent evening at my son's school starts at {value}.",
        "Thanks, the parent evening at {value}. Those evenings are usually quite useful.",
        ("What time does the parent evening start?", "When did I say the school evening begins?"),
        TIMES,
    ),
    FactTemplate(
        "time",
        "My yoga class on Wednesdays begins at {value}.",
        "Yoga at {value} on Wednesdays, got it. It is a great way to break up the week.",
        ("What time does my yoga class start?", "When is my Wednesday yoga class?"),
        TIMES,
    ),
)

OPENINGS = (0, 1, 2)  # small-talk exchanges before the fact


@dataclass(frozen=True)
class Conversation:
    """One generated item, before it is written as JSON."""

    id: str
    distance_turns: int
    messages: tuple[dict[str, str], ...]
    answers: tuple[str, ...]


def build_conversation(
    rng: random.Random, item_id: str, distance: int, fact: FactTemplate, value: str, answers: Sequence[str]
) -> Conversation:
    """One conversation with the fact ``distance`` exchanges before the question."""
    opening = rng.choice(OPENINGS)
    # fillers must not contain the answer: draw from those that do not
    pool = [f for f in FILLER if not contains_answer(f"{f[0]} {f[1]}", answers)]
    chosen = rng.sample(pool, opening + distance - 1)
    exchanges = [
        *chosen[:opening],
        (fact.statement.format(value=value), fact.acknowledgement.format(value=value)),
        *chosen[opening:],
    ]
    question = rng.choice(fact.questions)
    if contains_answer(question, answers):
        raise AssertionError(f"{item_id}: the question gives away the answer")
    messages = [
        m
        for user, assistant in exchanges
        for m in ({"role": "user", "content": user}, {"role": "assistant", "content": assistant})
    ]
    messages.append({"role": "user", "content": question})
    return Conversation(item_id, distance, tuple(messages), tuple(answers))


def build_all(seed: int, per_distance: int) -> list[Conversation]:
    """``per_distance`` conversations for each distance, fact kinds and values rotated."""
    rng = random.Random(seed)
    out = []
    for distance in DIALOGUE_DISTANCES:
        facts = list(FACTS)
        rng.shuffle(facts)
        used: dict[str, list[int]] = {}
        for k in range(per_distance):
            fact = facts[k % len(facts)]
            order = used.setdefault(fact.statement, rng.sample(range(len(fact.values)), len(fact.values)))
            value, answers = fact.values[order[(k // len(facts)) % len(order)]]
            out.append(
                build_conversation(
                    rng, f"dialogue-d{distance:02d}-{k + 1:03d}", distance, fact, value, answers
                )
            )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=TASKS_DIR / "dialogue.jsonl")
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--per-distance", type=int, default=32)
    args = parser.parse_args(argv)
    if len(set(FILLER)) != len(FILLER):
        raise SystemExit("FILLER has a duplicate exchange")
    conversations = build_all(args.seed, args.per_distance)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as f:
        for c in conversations:
            f.write(
                json.dumps(
                    {
                        "id": c.id,
                        "distance_turns": c.distance_turns,
                        "messages": list(c.messages),
                        "answers": list(c.answers),
                    },
                    ensure_ascii=False,
                )
                + "\n"
            )
    print(f"wrote {len(conversations)} conversations to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

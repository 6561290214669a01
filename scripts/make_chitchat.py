"""Build a synthetic "chit-chat" replay set (JSONL) for the memory proxy's cost evaluation.

Each conversation is casual everyday small talk: short user messages (15-45 words) and short
assistant replies (25-60 words), grouped into sessions three days apart (1-3 minutes between
messages inside a session). Facts the user states once (names, codes, dates, plans, some later
changed) are planted in early and middle sessions and probed at the end of a later session.

Why: this is a held-out style set unlike long technical chats. With short messages and long
pauses, sending the full history to a warm prompt cache is cheap, so a memory rewrite has
little to save and must not bill more than the plain full-history baseline.

Standard library only, deterministic for a given --seed. Usage (defaults shown):
  python3 make_chitchat.py --conversations 5 --sessions 10 --turns-per-session 10 --seed 0 --out chitchat.jsonl
"""
import argparse
import json
import random
import re
import sys
from datetime import datetime, timedelta

BANK = {  # filler slots; none may contain a planted value (validate() checks)
    "hobby": "pottery|bouldering|watercolour painting|chess|birdwatching|knitting|the guitar|gardening|baking bread",
    "dish": "lentil curry|mushroom risotto|pad thai|shakshuka|dumplings|ramen|veggie tacos|gnocchi|falafel wraps",
    "place": "the farmers market|the old cinema|the botanical garden|the flea market|the climbing gym|the pier",
    "day": "on Saturday|on Sunday|on Friday evening|tomorrow|this weekend|next weekend",
    "when": "yesterday|last night|this morning|over the weekend|earlier today",
    "feel": "exhausted|weirdly energetic|a bit restless|pretty relaxed|behind on everything",
    "show": "that baking competition show|the detective series everyone mentions|a nature documentary|an old sitcom|"
            "a cooking podcast|that reality show about islands",
    "chore": "laundry|meal prep|fixing the wobbly shelf|sorting the balcony|deep-cleaning the oven|ironing|repotting",
    "work": "the quarterly report|a client presentation|onboarding a new hire|the budget review|a website migration|"
            "the office move|an endless audit",
    "relative": "mum|dad|aunt|grandparents|cousin|uncle", "pet": "cat|dog|old cat|puppy",
    "weather": "rainy|sunny|windy|freezing|muggy|grey",
    "trip": "a weekend in the mountains|a road trip along the coast|a quick city break|a camping trip|"
            "a night at a cabin|a train ride somewhere new",
}
BANK = {k: v.split("|") for k, v in BANK.items()}
# user sentences, {slot}s filled from BANK; replies whose slots the user just filled go first
USER = """Spent {when} on {hobby} and completely lost track of time.
I'm attempting {dish} tonight, wish me luck with that one.
Work has been all about {work} this week, and I'm {feel}.
Thinking about heading to {place} {day} if it stays {weather}.
My {relative} called {when} and we chatted for almost an hour about nothing.
The {pet} knocked a mug off the table {when}, classic move.
It's been {weather} all day here, so I mostly stayed in with {chore}.
We're toying with the idea of {trip} sometime soon.
I finally finished {show} and now I have no idea what to watch next.
Had {dish} at a tiny place near {place}, surprisingly good.
Honestly I'm {feel} today, too much screen time probably.
Tried to get back into {hobby} but my hands have forgotten everything.
My {relative} keeps sending me recipes for {dish}, I think that's a hint.
My plan for {day} is {chore} and then absolutely nothing else.
I walked past {place} {when} and it was packed with people.
Not sure whether to sign up for a {hobby} class or keep it casual.
Third coffee already, it's one of those days.
The {pet} has claimed my chair again and I don't have the heart to move it.
The meeting about {work} ran long, so lunch was a sad sandwich at my desk.
I might invite a few friends over {day} and cook {dish}.
Still torn between {trip} and just staying home to rest.
The bus was late again {when}, so I ended up walking half the way.
Someone recommended {show} to me, is it worth starting?
Bought a fresh notebook for {hobby} ideas, which I will probably never fill.""".splitlines()
USER_CLOSE = ["Anyway, how are you?", "What would you do?", "Any thoughts?", "Just felt like sharing.",
              "Enough rambling."]
ASSIST = """Honestly, {hobby} {day} sounds like the perfect reset.
{hobby} is one of those things that comes back faster than you expect.
You can never go wrong with {dish} after a long week.
Maybe cook {dish} {day} and call it a proper break.
If it turns {weather}, {place} might be less fun, so keep a backup plan.
{place} sounds like a lovely change of scene, especially when it's {weather}.
A quiet day {day} with nothing scheduled can do wonders.
Small wins count, even if it's just getting through {chore}.
Feeling {feel} after {work} is completely understandable.
People seem to either adore or abandon {show} after two episodes.
Honestly, {show} is great background noise for {chore}.
If you do go for {trip}, packing light will save you a headache.
Something like {trip} {day} could be exactly what you need.
Long chats with your {relative} like that are worth a lot.
Maybe your {relative} would join you for {hobby} some time.
Things like {work} always take longer than planned, so be kind to yourself.
A good playlist makes {chore} far less painful.
Your {pet} clearly has a talent for picking exactly the wrong moment.
Your {pet} sounds like the real boss of the household.
A short walk afterwards might help, fresh air usually does.
Those are the little details that end up making a week memorable.
It sounds like you could use an evening that asks nothing of you.
Honestly, letting a plan stay loose is underrated.""".splitlines()
ASSIST_OPEN = ["Ha, fair enough.", "Oh nice.", "Ah, I hear you.", "Totally get that.", "Sounds fun!", "Oof.", "Aw."]
ASSIST_ASK = ["What made you pick that?", "How are you feeling about it?", "Anything planned for after?",
              "Want a few ideas?", "Would you do it again?", "What's been the best part so far?"]

VALUES = {  # planted values: distinctive, each used at most once per conversation
    "fname": "Ilse Marta Anouk Saoirse Greta Oksana Freya Dagny Mireille Thandiwe Beatrix Ottilie Solveig Zofia Linnea",
    "mname": "Henrik Tobias Jonas Leopold Casimir Yusuf Radek Emeric Kwame Anselm",
    "pet": "Pixel Mochi Noodle Waffles Juniper Pretzel Ziggy Bramble", "allergen": "chicken salmon beef turkey lamb",
    "code": "4817 2093 7356 6621 9034 1578 3862 5049", "clock": "6:15 6:45 7:40 8:05 5:50 12:15 18:30 19:45",
    "plant": "Calathea Monstera Peperomia Maranta Philodendron Pilea Aglaonema",
    "city": "Lisbon Porto Ljubljana Tallinn Bergen Valencia Krakow Ghent Trieste Salzburg",
    "race": "Kestrel Ridge 12K|Heron Lake Half|Foxglove Trail 15K|Granite Pass 10K|Otter Creek 21K",
    "bakery": "Bluebell Crumb|The Rye Lantern|Copper Whisk|Little Levain|Oat and Anchor",
    "novel": "The Salt Orchard|A Lantern for Wednesday|Glass Harbour|The Quiet Cartographer|Nine Winters North",
}
VALUES = {k: v.split("|") if "|" in v else v.split() for k, v in VALUES.items()}
# (category, question, answer slot, message or "plan || later message"); every fact is planted in every
# conversation, one per category is probed. A slot's kind (VALUES key) is its name less digits.
# multi-session: both messages needed; knowledge-update: the evidence is the change (the second).
FACTS = [
    ("single-fact", "What is my sister's name?", "fname",
     "Oh, and my sister's name is {fname}, she's the one moving back from abroad next year."),
    ("single-fact", "What food is my cat allergic to?", "allergen",
     "Vet visit today: turns out my cat {pet} is allergic to {allergen}, so those treats are out."),
    ("single-fact", "What is the code for my bike lock?", "code",
     "Writing this down so it sticks: the code for the bike lock is {code}."),
    ("single-fact", "What kind of plant is on my desk at work?", "plant",
     "My new desk plant at work is a {plant}, my coworker swears it's impossible to kill."),
    ("multi-session", "Which race did I sign up for with {fname}?", "race",
     "My running buddy is {fname}, the reason I started doing trail races at all. || "
     "Just signed up for the {race} with my running buddy, feeling a bit nervous already."),
    ("multi-session", "Which bakery did {mname} recommend?", "bakery",
     "My brother {mname} is the sourdough fanatic of the family, he bakes every single Sunday. || "
     "My sourdough-obsessed brother insists the best bakery in town is {bakery}."),
    ("multi-session", "What novel did {fname} lend me?", "novel",
     "The colleague who sits next to me, {fname}, drinks nothing but matcha all day long. || "
     "The matcha colleague lent me a novel called {novel}, I'm two chapters in."),
    ("knowledge-update", "Where are we going on our autumn trip now?", "city2",
     "We're finally planning the autumn trip, looks like we're going to {city} with friends. || "
     "Change of plans: we moved the autumn trip from {city} to {city2}, the flights were way cheaper."),
    ("knowledge-update", "At whose place does the book club meet now?", "mname",
     "The book club meets at {fname}'s place on Thursdays, and {fname} always makes too much soup. || "
     "Book club news: we moved it from {fname}'s place to {mname}'s, it's closer to the tram."),
    ("knowledge-update", "What time is my spin class now?", "clock2",
     "My spin class is at {clock} on weekdays, which means a brutal alarm. || "
     "They moved my spin class from {clock} to {clock2}, so the schedule looks different now."),
    ("temporal", "What date is my flight to {city}?", "date",
     "I finally booked the flight to {city} for {date}, window seat and everything."),
    ("temporal", "When is my dentist appointment?", "date",
     "Dentist appointment is on {date}, I've been putting it off for ages."),
    ("temporal", "When is my parents' anniversary dinner?", "date",
     "My parents' anniversary dinner is on {date}, I need to find a gift soon."),
]
CATEGORIES = ["single-fact", "multi-session", "knowledge-update", "temporal"]
USER_WORDS, ASSIST_WORDS = (15, 45), (25, 60)
REPEAT_GAP = 100  # messages before a filler sentence may recur (keeps messages apart)


def norm(text):  # the eval's normalise(): lower case, punctuation to spaces, spaces folded
    return " ".join(re.sub(r"[^\w\s]+|_", " ", text.lower()).split())


def fill(template, vals):
    s = template.format(**vals)
    return s[0].upper() + s[1:]


def slots(template):  # in order of appearance (a set's order would vary with PYTHONHASHSEED)
    return list(dict.fromkeys(re.findall(r"{(\w+)}", template)))


def compose(rng, candidates, seen, now, lo, hi, target_lo, head=(), tail=()):
    """Head, then (text, slot values) candidates in order until a random target length, then tail;
    candidates said in the last REPEAT_GAP messages (seen: sentence -> message index) are skipped.
    Returns the text and the slot values of the sentences it used (for a reply that refers to them)."""
    target, parts, used = rng.randint(target_lo, hi), list(head), {}
    for strict in (True, False):  # a second pass allows recent sentences if the first fell short
        for s, vals in candidates:
            if len(" ".join(parts).split()) >= target - 4:
                break
            if s in parts or (strict and now - seen.get(s, -REPEAT_GAP) < REPEAT_GAP):
                continue
            if len(" ".join([*parts, s, *tail]).split()) <= hi:
                parts.append(s)
                used.update(vals)
                seen[s] = now
    text = " ".join(parts + list(tail))
    assert lo <= len(text.split()) <= hi, text
    return text, used


def conversation(rng, num, n_sess, turns, start):
    per = 2 * turns  # messages per session
    days = [start + timedelta(days=3 * s, hours=rng.randint(8, 20), minutes=rng.randint(0, 59)) for s in range(n_sess)]
    early = max(2, round(0.6 * n_sess))  # plants go into sessions [0, early)
    pools = {k: rng.sample(v, len(v)) for k, v in VALUES.items()}
    used, planted, dates, probes_by_cat = set(), {}, [], {}

    def slot(lo, hi):
        free = [(s, t) for s in range(lo, hi + 1) for t in range(turns) if (s, t) not in used]
        if not free:
            sys.exit("not enough turns to plant every fact; raise --sessions or --turns-per-session")
        used.add(pick := rng.choice(free))
        return pick[0] * per + 2 * pick[1]

    for cat, question, answer, text in FACTS:
        texts = text.split(" || ")
        idx = [slot(0, early - 1)]
        if len(texts) == 2:  # the second message comes in a later session
            idx.append(slot(idx[0] // per + 1, early if cat == "multi-session" else n_sess - 2))
        val = {}
        for key in sorted(set().union(*map(slots, texts))):
            if key == "date":  # 9-45 days after it is said; never a prefix of another date ("May 1"/"May 14")
                while True:
                    d = days[idx[0] // per] + timedelta(days=rng.randint(9, 45))
                    val[key] = f"{d:%B} {d.day}"
                    if not any(x.startswith(val[key]) or val[key].startswith(x) for x in dates):
                        break
                dates.append(val[key])
            else:
                val[key] = pools[key.rstrip("0123456789")].pop()
        planted.update((i, t.format(**val)) for i, t in zip(idx, texts, strict=True))
        ev = idx[-1:] if cat == "knowledge-update" else idx
        probes_by_cat.setdefault(cat, []).append(
            {"question": question.format(**val), "answers": [val[answer]], "evidence": ev, "category": cat})

    messages, clock, said, seen = [], None, {}, {}
    for i in range(n_sess * per):
        clock = days[i // per] if i % per == 0 else clock + timedelta(seconds=rng.randint(60, 180))
        if i % 2 == 0:  # user: fresh slot values per sentence
            cands = []
            for t in rng.sample(USER, len(USER)):
                vals = {k: rng.choice(BANK[k]) for k in slots(t)}
                cands.append((fill(t, vals), vals))
            tail = [rng.choice(USER_CLOSE)] if rng.random() < 0.35 else []
            text, said = compose(rng, cands, seen, i, *USER_WORDS, 34, [planted[i]] if i in planted else [], tail)
        else:  # assistant: first reactions to what the user just said, then anything
            fits = [t for t in ASSIST if slots(t) and set(slots(t)) <= said.keys()]
            cands = [(fill(t, {k: said[k] for k in slots(t)}), {}) for t in rng.sample(fits, len(fits))]
            cands += [(fill(t, {k: rng.choice(BANK[k]) for k in slots(t)}), {})
                      for t in rng.sample(ASSIST, len(ASSIST))]
            head = [rng.choice(ASSIST_OPEN)] if rng.random() < 0.6 else []
            text, _ = compose(rng, cands, seen, i, *ASSIST_WORDS, 50, head, [rng.choice(ASSIST_ASK)])
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text,
                         "time": clock.isoformat(timespec="seconds")})
    probes = []
    for cat in CATEGORIES:  # facts probed in turn across conversations, each at the end of the
        p = probes_by_cat[cat][num % len(probes_by_cat[cat])]  # last or a random session after its evidence
        last = max(p["evidence"]) // per
        end = n_sess - 1 if rng.random() < 0.5 else rng.randint(last + 1, n_sess - 1)
        probes.append({"after": per * (end + 1), **p})
    return {"id": f"c{num + 1}", "source": "chitchat-synthetic", "system": None, "messages": messages, "probes": probes}


def validate(conv, per):
    msgs, texts = conv["messages"], [norm(m["content"]) for m in conv["messages"]]
    assert len(set(texts)) == len(texts), f"{conv['id']}: duplicate message"
    for i, m in enumerate(msgs):
        assert m["role"] == ("user" if i % 2 == 0 else "assistant"), (conv["id"], i)
        assert m["role"] == "assistant" or datetime.fromisoformat(m["time"]), (conv["id"], i)
        lo, hi = USER_WORDS if m["role"] == "user" else ASSIST_WORDS
        assert lo <= len(m["content"].split()) <= hi, (conv["id"], i)
    for p in conv["probes"]:
        ev, tag = p["evidence"], (conv["id"], p["category"])
        assert ev and all(0 <= i < len(msgs) for i in ev), tag
        assert p["after"] % 2 == 0 and max(ev) + 1 <= p["after"] <= len(msgs), tag
        assert p["category"] != "multi-session" or len({i // per for i in ev}) == 2, tag
        for a in map(norm, p["answers"]):
            assert any(a in texts[i] for i in ev), tag  # the answer is in the evidence...
            assert not any(a in t for i, t in enumerate(texts) if i not in ev), tag  # ...and only there
            assert a not in norm(p["question"]), tag


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--conversations", 5), ("--sessions", 10), ("--turns-per-session", 10), ("--seed", 0)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--out", default="chitchat.jsonl")
    args = ap.parse_args()
    if args.sessions < 4:
        sys.exit("--sessions must be at least 4 (plants, updates, and a later probe session)")
    rng, start = random.Random(args.seed), datetime(2023, 5, 8)
    convs = [conversation(rng, k, args.sessions, args.turns_per_session, start + timedelta(days=k))
             for k in range(args.conversations)]
    for c in convs:
        validate(c, 2 * args.turns_per_session)
    with open(args.out, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(c, ensure_ascii=False) + "\n" for c in convs)
    for c in convs:
        toks = [len(m["content"]) / 4 for m in c["messages"]]
        print(f"{c['id']}: {len(toks)} messages, {sum(toks):.0f} tokens (len/4), {sum(toks) / len(toks):.1f}/message, "
              f"probes after {[p['after'] for p in c['probes']]}")
    print(f"wrote {len(convs)} conversations to {args.out}")


if __name__ == "__main__":
    main()

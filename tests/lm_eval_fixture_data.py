"""The made-up documents of tests/lm_eval_fixtures.py's tasks (deterministic)."""

# --- data ------------------------------------------------------------------------------------
# ARC: (id, question, choices, labels "ABCDE" or "12345", index of the answer)
ARC_TRAIN = [
    ("Mercury_T01", "Which part of a plant takes in water from the soil?", ["roots", "leaves", "flowers", "seeds"], "A", 0),
    ("Mercury_T02", "What is the main gas that plants take in from the air to make food?", ["oxygen", "nitrogen", "carbon dioxide", "helium"], "A", 2),
    ("MCAS_T03", "Which unit is best for measuring the length of a pencil?", ["centimeters", "kilograms", "liters"], "A", 0),
    ("Mercury_T04", "What happens to pure water when it is heated to 100 degrees Celsius at sea level?", ["It freezes.", "It boils.", "It melts.", "It condenses."], "A", 1),
    ("NYSEDREGENTS_T05", "Which material is the best insulator of electricity?", ["copper", "aluminum", "rubber", "iron"], "1", 2),
    ("Mercury_T06", "How long does it take Earth to travel once around the Sun?", ["one day", "one month", "one year", "one decade"], "A", 2),
    ("MEA_T07", "Which sense do people use to hear a bird singing?", ["sight", "hearing", "touch", "taste", "smell"], "A", 1),
    ("Mercury_T08", "A magnet will attract which of these objects?", ["a plastic spoon", "a glass marble", "a rubber band", "a steel paper clip"], "A", 3),
]
ARC_TEST = [
    ("Mercury_E01", "Which of these is a renewable resource?", ["coal", "natural gas", "wind", "petroleum"], "A", 2),
    ("Mercury_E02", "A student puts a metal spoon and a wooden spoon in a cup of hot water. After a few minutes the metal spoon feels hotter. Which property of metal explains this?", ["Metal is a good conductor of heat.", "Metal is magnetic.", "Metal has a high melting point.", "Metal reflects light."], "A", 0),
    ("MCAS_E03", "Which organ pumps blood through the human body?", ["lungs", "heart", "liver"], "A", 1),
    ("Mercury_E04", "What causes the seasons on Earth?", ["the changing distance between Earth and the Moon", "the rotation of Earth on its axis every 24 hours", "clouds blocking sunlight during part of the year", "the tilt of Earth's axis as Earth orbits the Sun", "the Sun giving off more energy in summer"], "A", 3),
    ("NYSEDREGENTS_E05", "Which tool would best help a student find the mass of a rock?", ["a metric ruler", "a balance", "a thermometer", "a graduated cylinder"], "1", 1),
    ("Mercury_E06", "Plants use energy from sunlight to make their own food. What is this process called?", ["respiration", "digestion", "photosynthesis", "evaporation"], "A", 2),
    ("MEA_E07", "Which state of matter has a definite volume but no definite shape?", ["solid", "liquid", "gas"], "A", 1),
    ("Mercury_E08", "A ball rolling across a carpet slows down and stops. Which force slows the ball?", ["gravity", "magnetism", "friction", "buoyancy"], "A", 2),
    ("Mercury_E09", "Which of these animals is a mammal?", ["shark", "frog", "whale", "salmon", "lizard"], "A", 2),
    ("MCAS_E10", "At what temperature does water freeze on the Celsius scale?", ["0 degrees", "32 degrees", "100 degrees", "212 degrees"], "A", 0),
    ("Mercury_E11", "Why does an astronaut weigh less on the Moon than on Earth?", ["The Moon has no air.", "The astronaut loses mass in space.", "The Moon is farther from the Sun.", "The Moon's gravity is weaker than Earth's."], "A", 3),
    ("NYSEDREGENTS_E12", "Which of these is an example of a physical change?", ["burning wood", "cutting paper", "rusting iron", "baking bread"], "1", 1),
    ("Mercury_E13", "Which layer of Earth is made mostly of liquid iron and nickel?", ["crust", "mantle", "outer core", "inner core"], "A", 2),
    ("MEA_E14", "What kind of organism is at the start of every food chain?", ["a producer such as grass", "a consumer such as a rabbit", "a decomposer such as a mushroom"], "A", 0),
    ("Mercury_E15", "Which is the best way to save water at home?", ["leaving the tap running while brushing teeth", "watering the lawn at noon", "taking shorter showers", "washing half loads of laundry"], "A", 2),
    ("Mercury_E16", "Which object in our solar system is a star?", ["the Moon", "the Sun", "Mars", "Jupiter", "Halley's Comet"], "A", 1),
]

# HellaSwag: (activity_label, ctx_a, ctx_b, endings, label, source_id); WikiHow rows carry the
# [header]/[title]/[step] markup that utils.preprocess removes.
HELLASWAG_TRAIN = [
    ("Washing dishes", "A woman stands at a kitchen sink full of soapy water. She", "scrubs a plate with a sponge", ["and rinses it under the tap before setting it on the rack.", "and throws the plate out of the window.", "while the sink turns into a swimming pool.", "then paints the plate bright green."], "0", "activitynet~v_t01"),
    ("Home and Garden", "[header] How to repot a houseplant [title] Choose a pot slightly larger than the old one. [step] The new pot should be about 5 cm wider.", "", ["[title] Water the plant a day before repotting. [step] Moist soil holds together and slides out more easily.", "[title] Paint the pot with nail polish. [step] Wait for it to dry in the oven.", "[title] Bury the old pot in the garden. [step] Leave the plant outside overnight.", "[title] Cut all the leaves off. [step] The plant will grow new ones in a day."], "0", "wikihow~t02"),
    ("Playing guitar", "A man sits on a stool holding an acoustic guitar. He", "tunes the strings one at a time", ["and then strums a slow chord progression.", "and then eats the guitar pick.", "before the guitar flies away.", "and then the stool starts to sing."], "0", "activitynet~v_t03"),
    ("Personal Care and Style", "[header] How to tie a tie [title] Drape the tie around your neck. [step] The wide end should hang about 30 cm lower than the narrow end.", "", ["[title] Cross the wide end over the narrow end. [step] Hold the crossing point with one hand.", "[title] Iron the tie while wearing it. [step] Be careful with the steam.", "[title] Tie the tie around your ankle instead. [step] This is the classic style.", "[title] Cut the narrow end off. [step] A shorter tie is easier to knot."], "0", "wikihow~t04"),
    ("Walking the dog", "A girl clips a leash onto a small brown dog. The dog", "wags its tail by the front door", ["as the girl opens it and they step outside.", "and then reads a newspaper on the couch.", "while the door turns into a river.", "and the leash starts to cook dinner."], "0", "activitynet~v_t05"),
    ("Food and Entertaining", "[header] How to make iced tea [title] Boil four cups of water. [step] Remove the pot from the heat once it reaches a rolling boil.", "", ["[title] Freeze the tea bags first. [step] Frozen bags do not steep.", "[title] Add six tea bags and let them steep. [step] Leave them in for about five minutes, then remove them.", "[title] Pour the water onto the floor. [step] Mop it up with the tea bags.", "[title] Put the pot in the dishwasher. [step] Run a full cycle."], "1", "wikihow~t06"),
    ("Raking leaves", "A man in a red jacket rakes leaves in a front yard. He", "gathers them into a large pile", ["and then his rake turns into a bicycle.", "and then stuffs the pile into a paper bag.", "before the leaves fly back onto the trees.", "while singing to the mailbox on the moon."], "1", "activitynet~v_t07"),
    ("Cars & Other Vehicles", "[header] How to check tire pressure [title] Find the recommended pressure for your car. [step] It is printed on a sticker inside the driver's door.", "", ["[title] Let all the air out first. [step] Flat tires are easier to measure.", "[title] Kick each tire hard. [step] The sound tells you the pressure.", "[title] Remove the valve cap and press the gauge onto the valve. [step] Read the number on the gauge.", "[title] Paint the tires black. [step] Shiny tires hold more air."], "2", "wikihow~t08"),
]
HELLASWAG_VALIDATION = [
    ("Removing ice from car", "Then, the man writes over the snow covering the window of a car, and a woman wearing winter clothes smiles. Then", "the man", ["adds wax to the windshield and cuts it.", "continues removing the snow on his car.", "puts on a christmas coat, knitted with netting.", "drives the car into the snow and gets stuck."], "1", "activitynet~v_-1IBHYS3L-Y"),
    ("Baking cookies", "A woman in an apron cracks two eggs into a mixing bowl. She", "adds flour and sugar", ["and stirs the batter with a wooden spoon.", "and then puts the bowl on her head like a hat.", "while the eggs hatch into small chickens.", "and throws the mixture out of the kitchen window."], "0", "activitynet~v_e02"),
    ("Home and Garden", "[header] How to water succulents [title] Check the soil before watering. [step] Push a finger about 3 cm into the soil to see if it is dry.", "", ["Water the plant every hour. [step] Succulents need constant moisture.", "Soak the soil completely, then let it drain. [step] Empty the saucer so the roots do not sit in water.", "Spray the leaves with milk. [step] This keeps pests away for a year.", "Put the plant in the freezer. [step] Cold air helps the roots grow."], "1", "wikihow~e03"),
    ("Shoveling snow", "A boy in a blue hat pushes a shovel along a snowy driveway. He", "lifts a heavy load of snow", ["and tosses it onto the pile beside the garage.", "and eats it like ice cream with a spoon.", "and the shovel turns into a snowman.", "then mails the snow to his grandmother."], "0", "activitynet~v_e04"),
    ("Health", "[header] How to treat a minor burn [title] Cool the burn right away. [step] Hold the area under cool running water for about ten minutes.", "", ["[title] Put butter on the burn. [step] Butter seals in the heat.", "[title] Pop any blisters. [step] This helps the skin breathe.", "[title] Rub ice directly on the skin for an hour. [step] The colder the better.", "[title] Cover the burn with a clean, non-stick bandage. [step] Change the bandage once a day."], "3", "wikihow~e05"),
    ("Brushing teeth", "A little girl stands on a stool in front of the bathroom mirror. She", "squeezes toothpaste onto her brush", ["and brushes her teeth in small circles.", "and paints a picture on the mirror.", "and the toothbrush starts to dance.", "then puts the tube in the bathtub to swim."], "0", "activitynet~v_e06"),
    ("Sports and Fitness", "[header] How to start running [title] Buy a pair of comfortable running shoes. [step] Try them on in the afternoon, when your feet are slightly larger.", "", ["[title] Run a marathon on your first day. [step] Pushing hard builds endurance fastest.", "[title] Run barefoot on gravel. [step] It toughens the soles of your feet.", "[title] Begin with short runs mixed with walking. [step] For example, run one minute and walk two minutes for twenty minutes.", "[title] Skip warming up. [step] Stretching wastes energy."], "2", "wikihow~e07"),
    ("Painting fence", "A man dips a wide brush into a can of white paint. He", "spreads the paint along the wooden fence", ["and the fence walks away down the street.", "in long, even strokes from top to bottom.", "then drinks the rest of the paint.", "while the brush paints the sky instead."], "1", "activitynet~v_e08"),
    ("Food and Entertaining", "[header] How to boil an egg [title] Place the eggs in a saucepan. [step] Add cold water until the eggs are covered by about 2 cm.", "", ["Bring the water to a boil, then turn down the heat. [step] Simmer for nine minutes for a firm yolk.", "Crack the eggs into the water first. [step] This is how boiled eggs are made.", "Put the saucepan in the refrigerator. [step] Wait overnight for the water to boil.", "Microwave the eggs in their shells for ten minutes. [step] Stand close to watch."], "0", "wikihow~e09"),
    ("Playing basketball", "Two teenagers play one on one on an outdoor court. One of them", "dribbles past the other", ["and the ball rolls up into the clouds.", "and the hoop runs away from the court.", "and lays the ball into the basket.", "then both of them sit down to knit a sweater."], "2", "activitynet~v_e10"),
    ("Pets and Animals", "[header] How to give a cat a pill [title] Hold the cat gently but firmly. [step] Wrapping the cat in a towel can keep it from scratching.", "", ["[title] Throw the pill across the room. [step] The cat will chase it and eat it.", "[title] Tilt the cat's head back and place the pill at the back of its tongue. [step] Close its mouth and stroke its throat until it swallows.", "[title] Dissolve the pill in the cat's bath water. [step] Cats absorb medicine through their fur.", "[title] Give the pill to the dog instead. [step] Dogs share with cats."], "1", "wikihow~e11"),
    ("Mowing the lawn", "A woman pulls the cord of a lawn mower in her back yard. The engine", "starts with a loud roar", ["and she begins pushing the mower in straight rows.", "and the mower flies over the house.", "and the grass grows taller as she mows.", "while she reads a book inside the mower."], "0", "activitynet~v_e12"),
    ("Finance and Business", "[header] How to make a monthly budget [title] Add up your monthly income. [step] Include your salary after taxes and any regular side income.", "", ["Spend everything on the first day. [step] This keeps the math simple.", "Hide your bank statements. [step] Not knowing avoids stress.", "Borrow money to pay your savings. [step] Debt counts as income.", "List your fixed expenses, such as rent and insurance. [step] Subtract them from your income to see what is left."], "3", "wikihow~e13"),
    ("Making a sandwich", "A man lays two slices of bread on a cutting board. He", "spreads peanut butter on one slice", ["and jelly on the other, then presses them together.", "and then irons the bread flat.", "and the bread jumps into the toaster by itself.", "while the knife sings a song about jelly."], "0", "activitynet~v_e14"),
    ("Education and Communications", "[header] How to study for a test [title] Start studying several days before the test. [step] Short sessions spread over time help you remember more.", "", ["[title] Stay up all night before the test. [step] Tired brains remember better.", "[title] Study with loud music and the television on. [step] Noise keeps you alert.", "[title] Review your notes and make flash cards. [step] Quiz yourself on the cards until you know every answer.", "[title] Read only the first page of each chapter. [step] The rest is usually repeated."], "2", "wikihow~e15"),
    ("Swimming", "A swimmer in a red cap stands on the starting block at one end of the pool. She", "dives into the water at the sound of the whistle", ["and starts swimming freestyle toward the far wall.", "and the pool drains itself instantly.", "and comes out completely dry.", "then climbs out to order a pizza."], "0", "activitynet~v_e16"),
]

# GSM8K: (question, answer with <<calculator>> notes and a final "#### <number>")
GSM8K_TRAIN = [
    ("Lena has 5 boxes of crayons with 16 crayons in each box. She loses 9 crayons. How many crayons does she have left?", "Lena has 5 * 16 = <<5*16=80>>80 crayons.\nAfter losing 9 she has 80 - 9 = <<80-9=71>>71 crayons.\n#### 71"),
    ("A shirt costs $20. It is on sale for 25% off. What is the sale price of the shirt?", "The discount is 20 * 25 / 100 = $<<20*25/100=5>>5.\nThe sale price is 20 - 5 = $<<20-5=15>>15.\n#### 15"),
    ("Carlos runs 3 miles every weekday and 5 miles on Saturday. He rests on Sunday. How many miles does he run in a week?", "On weekdays he runs 5 * 3 = <<5*3=15>>15 miles.\nIn a week he runs 15 + 5 = <<15+5=20>>20 miles.\n#### 20"),
    ("Two pizzas are each cut into 8 slices. Four friends each eat 3 slices. How many slices are left?", "There are 2 * 8 = <<2*8=16>>16 slices.\nThe friends eat 4 * 3 = <<4*3=12>>12 slices.\nSo 16 - 12 = <<16-12=4>>4 slices are left.\n#### 4"),
    ("A farmer collects 36 eggs and packs them into cartons that hold 12 eggs each. He sells each carton for $4. How much money does he make?", "He fills 36 / 12 = <<36/12=3>>3 cartons.\nHe makes 3 * 4 = $<<3*4=12>>12.\n#### 12"),
    ("Nina saves $15 each week. How many weeks will it take her to save $180?", "It will take her 180 / 15 = <<180/15=12>>12 weeks.\n#### 12"),
]
GSM8K_TEST = [
    ("Mia has 12 apples. She gives 4 to her brother and then buys 7 more. How many apples does Mia have now?", "After giving some away Mia has 12 - 4 = <<12-4=8>>8 apples.\nThen she has 8 + 7 = <<8+7=15>>15 apples.\n#### 15"),
    ("A bakery sells muffins for $3 each. On Monday it sold 24 muffins and on Tuesday it sold twice as many. How much money did the bakery make from muffins on those two days?", "On Tuesday it sold 24 * 2 = <<24*2=48>>48 muffins.\nIn total it sold 24 + 48 = <<24+48=72>>72 muffins.\nIt made 72 * 3 = $<<72*3=216>>216.\n#### 216"),
    ("A train travels at 60 miles per hour for 3 hours and then at 45 miles per hour for 2 hours. How many miles does it travel in total?", "First it travels 60 * 3 = <<60*3=180>>180 miles.\nThen it travels 45 * 2 = <<45*2=90>>90 miles.\nIn total it travels 180 + 90 = <<180+90=270>>270 miles.\n#### 270"),
    ("Jake reads 15 pages of his book every day. The book has 240 pages. How many days will it take him to finish the book?", "It will take him 240 / 15 = <<240/15=16>>16 days.\n#### 16"),
    ("A class has 28 students. Three quarters of them walk to school and the rest take the bus. How many students take the bus?", "28 * 3 / 4 = <<28*3/4=21>>21 students walk.\nSo 28 - 21 = <<28-21=7>>7 students take the bus.\n#### 7"),
    ("Sara bought 3 notebooks at $2.50 each and a pen for $1.25. She paid with a $10 bill. How much change did she get?", "The notebooks cost 3 * 2.50 = $<<3*2.5=7.5>>7.50.\nIn total she spent 7.50 + 1.25 = $<<7.5+1.25=8.75>>8.75.\nHer change was 10 - 8.75 = $<<10-8.75=1.25>>1.25.\n#### 1.25"),
    ("A garden has 5 rows of tomato plants with 8 plants in each row. Each plant produces 6 tomatoes. How many tomatoes does the garden produce?", "There are 5 * 8 = <<5*8=40>>40 plants.\nThey produce 40 * 6 = <<40*6=240>>240 tomatoes.\n#### 240"),
    ("The temperature was 4 degrees in the morning and dropped 11 degrees by midnight. What was the temperature at midnight?", "At midnight the temperature was 4 - 11 = <<4-11=-7>>-7 degrees.\n#### -7"),
    ("A company had 1,200 employees. It hired 350 more, and then 150 employees retired. How many employees does the company have now?", "After hiring it had 1,200 + 350 = <<1200+350=1550>>1,550 employees.\nAfter the retirements it has 1,550 - 150 = <<1550-150=1400>>1,400 employees.\n#### 1400"),
    ("Tom is 3 times as old as his daughter. In 12 years he will be twice as old as she will be. How old is Tom now?", "Let his daughter be d years old, so Tom is 3d.\nIn 12 years 3d + 12 = 2(d + 12), so d = <<24-12=12>>12.\nTom is 3 * 12 = <<3*12=36>>36 years old.\n#### 36"),
]

# WikiText (wikitext-2-raw-v1 document-level style: spaced punctuation, @-@ / @,@ / @.@ joins)
WIKITEXT_TEST = [
    (
        " = Harwick Lighthouse = \n \n Harwick Lighthouse is a disused lighthouse on the northern headland of "
        "Carrow Bay . Built in 1868 , it guided fishing boats into the harbour for almost a century . The tower "
        "is 21 metres ( 69 ft ) tall and was painted in red and white bands . It was switched off in 1961 and "
        "now houses a small maritime museum . \n"
    ),
    (
        " = Station Road railway station = \n \n Station Road was a railway station on the Ashby branch line . It "
        "opened on 3 May 1884 and closed to passengers in 1952 , although goods trains used the line until 1966 "
        ". The station had a single platform , a wooden waiting room and a signal box with 12 levers . \n \n The "
        "station building survives as a private house . The trackbed east of the station is now a footpath and "
        "cycle route , opened in 1998 . \n"
    ),
    (
        " = River Calder ( Wenmoor ) = \n \n The River Calder is a river in the uplands of Wenmoor . It rises on "
        "the slopes of Black Hill at a height of 540 metres ( 1 @,@ 770 ft ) and flows south @-@ east for 38 "
        "kilometres ( 24 mi ) before joining the River Ouse near Keldby . \n \n = = Course = = \n \n In its upper "
        "course the river runs through a narrow , steep valley cut into gritstone . Below the village of Hollins "
        "it enters a broad flood plain , where it was straightened in the 19th century to drive the mills at "
        "Keldby . Several weirs survive from this period , and the largest , Mill Weir , is 3 @.@ 5 metres high "
        ". \n \n = = Wildlife = = \n \n The Calder 's clean upper waters support brown trout , bullheads and white "
        "@-@ clawed crayfish . Otters returned to the river in the 1990s after an absence of more than forty "
        "years . \n"
    ),
    (
        " = Amber marsh moth = \n \n The amber marsh moth ( Paludia ambrata ) is a moth of the family Noctuidae . "
        "It is found in wet meadows and reed beds across northern Europe , from Ireland east to the Baltic "
        "states . \n \n The wingspan is 32 @-@ 38 mm . The forewings are pale amber with a darker band near the "
        "outer edge , and the hindwings are greyish white . Adults fly at night from late June to August and are "
        "attracted to light . \n \n = = Life cycle = = \n \n The female lays her eggs in rows on the leaves of reed "
        "sweet @-@ grass . The caterpillars hatch after about ten days and feed inside the stems , where they "
        "are hidden from birds . They spend the winter as half @-@ grown larvae and pupate in May of the "
        "following year , usually just above the water line . \n \n = = Status = = \n \n The species has declined "
        "since the 1950s as wetlands were drained for farming . It is listed as vulnerable in several countries "
        ", and surveys in 2015 found it at fewer than 40 sites in Britain . Conservation work , such as raising "
        "water levels in reed beds , has helped local populations recover . \n"
    ),
    (
        " = SS Carrow Star = \n \n SS Carrow Star was a British cargo steamship built in 1911 by Hartley & Sons of "
        "Sunderland . She carried coal from the north of England to ports in the Baltic and the Mediterranean , "
        "and was requisitioned by the Admiralty during the First World War . \n \n = = Design = = \n \n Carrow Star "
        "was 84 @.@ 4 metres ( 277 ft ) long , with a beam of 12 @.@ 2 metres ( 40 ft ) and a gross register "
        "tonnage of 2 @,@ 950 . She was powered by a triple expansion steam engine that drove a single screw and "
        "gave her a speed of 9 knots ( 17 km / h ) . Her four holds were served by eight derricks , and she had "
        "accommodation for a crew of 28 . \n \n = = Service = = \n \n After her launch in March 1911 , Carrow Star "
        "sailed mainly between the Tyne and Riga . In 1915 she was taken over as a collier to supply coal to the "
        "fleet at Scapa Flow , and in 1917 she survived a torpedo attack off the coast of Norway when the "
        "torpedo passed under her stern . She returned to her owners in 1919 . \n \n During the 1920s the ship "
        "traded to Spain and Italy , carrying coal on the outward voyage and iron ore or fruit on the return . "
        "Falling freight rates led her owners to lay her up in 1931 , and she was sold the following year to a "
        "Greek company , who renamed her Agia Eleni . \n \n = = Loss = = \n \n On 14 January 1937 Agia Eleni ran "
        "aground in fog on a reef near the island of Kythira while carrying grain from Odessa . Her crew were "
        "rescued by fishing boats from the island , but the ship broke in two during a storm a week later and "
        "was declared a total loss . \n"
    ),
    (
        " = Margaret Hollis = \n \n Margaret Hollis ( 12 April 1902 – 8 November 1979 ) was an English composer "
        "and music teacher . She is best known for her choral works and for her songs for children , several of "
        "which are still sung in British schools . \n \n = = Early life = = \n \n Hollis was born in Keldby , the "
        "youngest of five children of a mill manager and a piano teacher . She learned the piano from her mother "
        "and sang in the parish choir , where the organist encouraged her to write hymn tunes . In 1920 she won "
        "a scholarship to the Royal College of Music in London , where she studied composition for four years "
        ". \n \n = = Career = = \n \n After leaving the college Hollis returned to the north and taught music at a "
        "girls ' school in Leeds . Her first published work , a set of six songs for children , appeared in 1927 "
        "and sold well . It was followed by a cantata , The Lantern Fair , which was first performed in 1931 by "
        "the Keldby Choral Society with the composer conducting . \n \n During the Second World War she organised "
        "concerts for factory workers and wrote a number of short pieces for amateur orchestras , which often "
        "lacked players . Critics praised the simple , singable melodies of these works and their careful "
        "writing for young voices . In 1948 she was appointed director of music at a teacher training college , "
        "a post she held until her retirement in 1964 . \n \n = = Later life and legacy = = \n \n In retirement "
        "Hollis continued to compose , and she completed her largest work , a setting of psalms for choir and "
        "brass band , in 1970 . She died in Keldby at the age of 77 . A collection of her manuscripts is held by "
        "the city library , and a music prize for young composers has been awarded in her name since 1982 . \n"
    ),
]

# LAMBADA: passages whose last word is the target (lm-eval's lambada_openai splits at the last space)
LAMBADA_TEST = [
    "Every morning the old fisherman walked down to the harbour to look at the boats . He had spent his whole "
    "life on the water , and even now he could not keep away from the sea",
    "Anna put the kettle on and took two cups from the shelf . When her brother came in from the garden , cold "
    "and tired , she handed him a cup of hot tea",
    "The children had been promised a trip to the zoo if it stopped raining . At nine o'clock the clouds broke , "
    "the sun came out , and they ran to the car shouting that they were going to the zoo",
    "He searched every pocket of his coat twice before he admitted it : he had left his keys on the kitchen "
    "table , and the door had locked behind him . He would have to call his landlord about the keys",
    "The orchestra tuned up while the hall slowly filled . Then the lights went down , the conductor raised his "
    "arms , and the first notes of the symphony rose into the silent hall",
    "Maria counted the coins on the counter again . She had exactly enough for the bread but not for the milk , "
    "so she put the bottle back on the shelf and paid for the bread",
]

# Winogrande: the blank "_" is filled with each option (the choices are contexts; the continuation,
# the text after the blank, is shared); answer "1" or "2"
WINOGRANDE_TRAIN = [
    ("The trophy doesn't fit into the brown suitcase because the _ is too large.", "trophy", "suitcase", "1"),
    ("The trophy doesn't fit into the brown suitcase because the _ is too small.", "trophy", "suitcase", "2"),
    ("Sarah lent her bike to Maria because _ did not need it that week.", "Sarah", "Maria", "1"),
    ("Sarah lent her bike to Maria because _ needed it to get to work.", "Sarah", "Maria", "2"),
]
WINOGRANDE_VALIDATION = [
    ("The cat chased the mouse until the _ got tired and stopped running.", "cat", "mouse", "1"),
    ("The lamp could not light the whole room because the _ was too dim.", "lamp", "room", "1"),
    ("John could not lift the box onto the shelf because the _ was too heavy.", "box", "shelf", "1"),
    ("The water poured from the bottle into the cup until the _ was full.", "bottle", "cup", "2"),
    ("Kevin always beat Ryan at chess because _ had studied the openings for years.", "Kevin", "Ryan", "1"),
]

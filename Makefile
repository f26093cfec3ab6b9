# The README's two commands are `make run` and `make test`; the logic lives in scripts/.
.PHONY: run test setup lint images docs

run:
	bash scripts/run.sh

test:
	bash scripts/test.sh

setup:
	bash scripts/setup.sh test

lint:
	.venv/bin/ruff check epd tests bench scripts

images:
	.venv/bin/python scripts/make_example_images.py

docs:
	.venv/bin/python -m epd.statemachine.diagram

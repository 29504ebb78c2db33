"""What the client suites ask for: a city as a typed answer, and the weather question
whose tool they declare with their own helpers."""

from __future__ import annotations

from pydantic import BaseModel

WHERE = "Paris is in which country?"
WEATHER_ASK = "What is the weather in Paris?"


class City(BaseModel):
    name: str
    country: str


def paris(city: City) -> None:
    assert city.name.strip().lower() == "paris", city
    assert city.country.strip().lower() == "france", city

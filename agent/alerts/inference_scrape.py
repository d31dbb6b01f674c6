"""The `inference_scrape` alert family (ADAPTER: to be moved into this module, see family.py)."""
from __future__ import annotations

from hybridmon.agent.alerts.family import AlertFamily
from hybridmon.agent.detectors.base import InferenceScrape as Settings
from hybridmon.agent.detectors.inference import ScrapeFailingDetector
from hybridmon.rules import cases_inference, inference

FAMILY = AlertFamily(
    section="inference_scrape",
    settings=Settings,
    alertnames=('InferenceServerScrapeFailing',),
    group="hybridmon-inference",
    detector=ScrapeFailingDetector,
    alerts=lambda t: (inference.scrape_failing(t),),
    cases=lambda t, catalog: [cases_inference.scrape_failing(t, catalog)],
    collectors=(),
    lookback_seconds=lambda settings: 0.0,
)

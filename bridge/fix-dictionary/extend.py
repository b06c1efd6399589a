"""Merges STE's extension (FIX44-STE-extension.xml, beside this file) into a stock QuickFIX
FIX 4.4 data dictionary.

usage: python3 extend.py STOCK_FIX44.xml OUT.xml

Each <component>/<group> of the extension names a group of the stock dictionary; its fields are
appended to that group's entries, in order. Every field must already be defined in the stock
dictionary with the same number, and must not be in the group yet.
"""

import os
import sys
import xml.etree.ElementTree as ET

EXTENSION = os.path.join(os.path.dirname(os.path.abspath(__file__)), "FIX44-STE-extension.xml")


def main():
    stock_path, out_path = sys.argv[1], sys.argv[2]
    tree = ET.parse(stock_path)
    root = tree.getroot()
    numbers = {f.get("name"): f.get("number") for f in root.find("fields")}
    components = {c.get("name"): c for c in root.find("components")}
    for component in ET.parse(EXTENSION).getroot().findall("component"):
        target = components.get(component.get("name"))
        if target is None:
            sys.exit(f"no component {component.get('name')} in {stock_path}")
        for group in component.findall("group"):
            into = target.find(f"group[@name='{group.get('name')}']")
            if into is None:
                sys.exit(f"no group {group.get('name')} in component {component.get('name')}")
            present = {f.get("name") for f in into.findall("field")}
            for field in group.findall("field"):
                name = field.get("name")
                if numbers.get(name) != field.get("number"):
                    sys.exit(f"field {name} is not tag {field.get('number')} in {stock_path}")
                if name in present:
                    sys.exit(f"field {name} is already in group {group.get('name')}")
                ET.SubElement(into, "field", {"name": name, "required": field.get("required", "N")})
    tree.write(out_path, encoding="UTF-8", xml_declaration=True)


if __name__ == "__main__":
    main()
